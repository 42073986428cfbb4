// The core, as the libraries around it reach it: the one door of fsdp::optim, fsdp::checkpoint,
// fsdp::tp, fsdp::data and fsdp::pp into the sharding core. Besides the check and
// error macros (fsdp/internal/check.h) and the public headers, this is all those libraries include
// of fsdp/: what they may do with a wrapped model's ranks, groups and state, and nothing of how the
// core keeps them (RunState, Unit, Access stay inside fsdp/).
//
// Why one door: the core's internals then change without touching the libraries around it, and a
// new library (pipeline stages) comes in through the same few functions instead of reaching into
// the run state. Every function here is exported (FSDP_API); none takes or returns the run state.
//
// What it offers:
//   - the agreement: every rank of the model's step is at the same call (agree), and the one
//     "agree, then all-reduce" (all_reduce);
//   - failures: a failure inside a collective marks the model broken (breaks_on_failure,
//     mark_broken);
//   - the groups: the model's data-parallel group, its step's, its checkpoint's, its
//     tensor-parallel one, its replicas' (train_replicas_apart), a DeviceMesh's along a dimension;
//     each a Comm (fsdp/internal/comm.h): bounded by the timeout, counted, flight-recorded;
//   - the step: gradients reduced or not, rescaled by the library;
//   - the outer state of replicas that train apart (LocalSGD / DiLoCo), which checkpoints save.
// The units and their shard specs are public (FSDPModule::shard_specs, fsdp/shard_spec.h).
#pragma once

#include "fsdp/device_mesh.h"
#include "fsdp/export.h"
#include "fsdp/fully_shard.h"
#include "fsdp/internal/calls.h"
#include "fsdp/internal/comm.h"

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace fsdp::detail {

// --- The agreement --------------------------------------------------------------------------------

/// The model's agreement at a step boundary: every rank of the step (the data-parallel group, or
/// the shard group while replicas train apart) is at call `call` with the same `payload`, after the
/// same collectives of the model since the last agreement (docs/design.md, "Ranks on the same
/// path"). `what` names it in errors; every rank's `vote` comes back. A difference fails every rank
/// and marks the model broken. Between steps, on the training thread.
FSDP_API std::vector<int64_t> agree(const FSDPModule& model, Call call, uint64_t payload, const std::string& what,
                                    int64_t vote = 0);

/// Which ranks all_reduce spans: those of a training step (the data-parallel group, or only the
/// shard group while replicas train apart), or every data-parallel rank whatever the mode (a load's
/// byte counts).
enum class Span { kStep, kModel };

/// The one "agree, then all-reduce": every rank is at this call (`what`, equal on every rank, and
/// the tensor's size), then `tensor` is reduced in place over the ranks `span` says (over a mesh
/// with tensor parallelism, then over its tensor-parallel ranks too): for what the library computes
/// from shards (a global norm, the scaler's overflow, a load's byte counts). A failure marks the
/// model broken.
FSDP_API void all_reduce(const FSDPModule& model, at::Tensor& tensor, c10d::ReduceOp op, const std::string& what,
                         Span span = Span::kStep);

// --- Failures -------------------------------------------------------------------------------------

/// Runs `fn` (collectives of the model's groups outside its steps: an outer step, a checkpoint's
/// exchange); a failure marks the model broken (its ranks no longer agree on the sequence of
/// collectives) and is rethrown.
FSDP_API void breaks_on_failure(const FSDPModule& model, const std::function<void()>& fn);
/// Marks the model broken: every later forward refuses, saying `why` and `remedy` (what to do).
FSDP_API void mark_broken(const FSDPModule& model, const std::string& why, const std::string& remedy);

// --- The groups -----------------------------------------------------------------------------------

/// The model's data-parallel group (every rank that holds a shard of its units): where() and
/// error_context() name this rank in messages.
FSDP_API const Comm& model_group(const FSDPModule& model);
/// The group a checkpoint of the model spans: its data-parallel group, or over a mesh with tensor
/// parallelism the mesh's whole world (its tensor-parallel ranks hold different parts). The model's
/// own communication context, not a copy (its statistics and call log); the pointer keeps it alive.
FSDP_API std::shared_ptr<Comm> checkpoint_group(const FSDPModule& model);
/// Whether checkpoint_group spans more ranks than the model's step agreement (a mesh with tensor
/// parallelism, or replicas that train apart).
FSDP_API bool checkpoint_wider_than_step(const FSDPModule& model);
/// The model's tensor-parallel group (null without tensor parallelism).
FSDP_API const Comm* tensor_parallel_group(const FSDPModule& model);
/// A new communication context over `mesh`'s group along `dim` (a dimension or "dp"), with
/// statistics and a call log of its own, bounded by the mesh's timeout.
FSDP_API std::shared_ptr<Comm> mesh_group(const DeviceMesh& mesh, const std::string& dim, bool verify);
/// A new communication context over `pg` with statistics and a call log of its own, bounded by
/// `timeout` (an asynchronous saver's group, a tensor-parallel group without a mesh).
FSDP_API std::shared_ptr<Comm> own_group(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                         std::chrono::milliseconds timeout, GroupInfo info, bool verify = false);

// --- Replicas that train apart (fsdp::optim::LocalSGD, DiLoCo) ------------------------------------

/// From now on (for the model's lifetime) hybrid sharding's replicas train apart between outer
/// steps, and the returned group is this rank's replicate group (the ranks holding the same shard in
/// the other replicas), for the outer step. Throws, naming `caller`, unless every unit of `model` is
/// hybrid-sharded, or between a forward and its backward. First every data-parallel rank agrees on
/// `settings` (a fingerprint of the caller's options, `text` in words): a rank with other settings
/// fails every rank at once.
FSDP_API Comm& train_replicas_apart(const FSDPModule& model, const std::string& caller, uint64_t settings,
                                    const std::string& text);
/// Whether the model's replicas train apart: its steps' sums span one replica.
FSDP_API bool replicas_apart(const FSDPModule& model);

/// What a checkpoint of replicas that train apart needs of LocalSGD / DiLoCo beyond the model
/// (implemented in optim/internal/replica_sync.cpp, read by checkpoint/internal/replicas.cpp).
struct FSDP_API OuterState {
  virtual ~OuterState() = default;
  virtual std::string kind() const = 0;  ///< "LocalSGD" or "DiLoCo"
  virtual int64_t sync_every() const = 0;
  virtual int64_t inner_steps() const = 0;
  virtual void set_inner_steps(int64_t n) = 0;
  /// Applies an outer exchange still in flight (the overlapped variant).
  virtual void flush() = 0;
  /// Per parameter (shard_specs() order): the global state's rows on this rank, fp32. DiLoCo's
  /// global shards; LocalSGD keeps none, so it takes the replicas' mean now (a collective over the
  /// replicate group: every rank calls it).
  virtual std::vector<at::Tensor> global_shards() = 0;
  /// DiLoCo's outer optimizer over global_shards() (null for LocalSGD).
  virtual torch::optim::Optimizer* outer_optimizer() = 0;
};
/// The model's outer state (null: none registered, or its object is gone).
FSDP_API std::shared_ptr<OuterState> outer_state(const FSDPModule& model);
/// Registers `outer` (observed, not owned) as the model's outer state.
FSDP_API void set_outer_state(const FSDPModule& model, const std::weak_ptr<OuterState>& outer);

// --- The step -------------------------------------------------------------------------------------

/// Throws, naming `caller`, while gradients accumulated with gradient sync off wait unreduced
/// (see FSDPModule::set_requires_gradient_sync): stepping or clipping now would miss them.
FSDP_API void check_gradients_reduced(const FSDPModule& model, const char* caller);
/// The library rescaled the sharded gradients in place on purpose (clip_grad_norm, the scaler's
/// unscale_): not the program's habit the next forward warns about (internal/step_watch.h).
FSDP_API void gradients_rescaled(const FSDPModule& model);

}  // namespace fsdp::detail
