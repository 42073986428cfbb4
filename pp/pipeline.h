// fsdp::pp::Pipeline: runs a schedule's action list (pp/schedule.h) on this rank's stages, one
// training step at a time: each stage's forward on its microbatches, their backwards (whole, or
// split into the input and the weight gradient for zero bubble), and the transfers between stages
// (pp/point_to_point.h).
//
//   fsdp::pp::StageLayout layout(mesh.size("pp"));
//   auto lists = fsdp::pp::make_schedule(fsdp::pp::ScheduleKind::k1F1B, layout, M);
//   fsdp::pp::Pipeline pipe(mesh, layout, lists, M, {{stage, [&](const at::Tensor& x) { return net(x); },
//                                                     net->parameters()}});
//   auto r = pipe.step([&](int64_t m) { return ids_of(m); },                       // the first stage's inputs
//                      [&](const at::Tensor& out, int64_t m) { return loss_of(out, m); });  // the last stage's
//   opt.step();   // each stage's gradients, summed over the microbatches
//
// The constructor validates the lists (pp/simulate.h: every rank simulates all ranks' lists, so
// no step starts on a schedule that would hang) and checks that every pipeline rank holds the
// same lists, bounded by the mesh's timeout; a refusal is std::invalid_argument naming the action,
// a difference between ranks an fsdp::Error on every rank.
//
// The loss function returns microbatch m's share of the step's loss (for one process's
// equivalent over the global batch: its mean loss times its tokens over the batch's); its
// backward accumulates into the stage's gradients, as gradient accumulation does. Each stage's
// input is a leaf of its own graph (received, or handed over in memory by this rank's previous
// stage), so a stage's backward stops at its input and the gradient there goes back a stage.
//
// Zero bubble's split backward (pp/split_backward.h): the input pass (I) computes the gradient at
// the stage's input and keeps the gradients reaching the weight-consuming nodes; the weight pass
// (W) runs from those nodes to the weights only.
//
// An FSDP stage (Stage::module set: the stage's model wrapped by fully_shard over the stage's own
// ranks, pp/stage_mesh.h) is driven through FSDPModule's pipeline controls, as PyTorch's pipelining
// drives FSDP2: during a step its units stay gathered from their first forward to the step's end
// and its gradients accumulate without sync; after the stage's last backward (B or W) of the
// step, reduce_gradients() reduce-scatters them once and reshards. A step thus costs each unit one
// all-gather and one reduce-scatter, whatever the microbatches. Stage::reshard_between_microbatches
// trades that for memory: each forward and backward gathers again (FSDP's own schedule), the
// reduction still once. Before a W the stage is gathered (unshard), since W adds into the full
// parameters' gradients without autograd's accumulation hooks. The controls are back to their
// defaults (sync as before the step, resharding on) when the step ends.
#pragma once

#include "fsdp/device_mesh.h"
#include "fsdp/export.h"
#include "fsdp/fully_shard.h"
#include "pp/action.h"
#include "pp/point_to_point.h"
#include "pp/stage_layout.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::pp {

/// One stage this rank holds: its index, its computation (token ids on the first stage, the
/// previous stage's output elsewhere; returns what the next stage takes, or what the loss takes
/// on the last) and the parameters its weight-gradient pass differentiates (empty with `module`:
/// the module's).
struct Stage {
  int64_t index = 0;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::vector<at::Tensor> parameters;
  /// The stage's FSDP model, when `forward` calls one: the pipeline drives it (see above).
  std::optional<FSDPModule> module;
  /// With `module`: gather for each microbatch's forward and backward instead of once per step.
  bool reshard_between_microbatches = false;
};

/// What one step did on this rank.
struct StepReport {
  double loss = 0;              ///< the sum of the last stage's microbatch losses (0 on other ranks)
  double step_seconds = 0;      ///< the step, from its first action to its last send's completion
  double p2p_wait_seconds = 0;  ///< spent waiting on receives and on sends to complete
  int64_t peak_in_flight = 0;   ///< the most microbatch-stages held at once (forward run, backward not)
  int64_t p2p_bytes = 0;        ///< sent plus received (PointToPoint's count)
  double bubble() const { return step_seconds > 0 ? p2p_wait_seconds / step_seconds : 0.0; }
};

class Pipeline {
 public:
  using Input = std::function<at::Tensor(int64_t microbatch)>;
  using Loss = std::function<at::Tensor(const at::Tensor& output, int64_t microbatch)>;

  /// Over `mesh`'s pp group; `stages`: the stages `layout` gives this rank (any order).
  /// Collective over the pipeline's ranks (the lists' check).
  Pipeline(const DeviceMesh& mesh, const StageLayout& layout, ActionLists lists, int64_t microbatches,
           std::vector<Stage> stages, const at::Device& device = at::kCPU);

  /// One step's actions. `input(m)`: microbatch m's input of the first stage (called on its rank
  /// only); `loss(out, m)`: its scaled loss from the last stage's output (its rank only).
  StepReport step(const Input& input, const Loss& loss);

  const StageLayout& layout() const { return layout_; }
  const ActionLists& lists() const { return lists_; }
  int64_t microbatches() const { return microbatches_; }
  PointToPoint& p2p() { return p2p_; }

 private:
  struct Slot;  // one stage and microbatch's tensors while in flight
  PointToPoint p2p_;
  StageLayout layout_;
  ActionLists lists_;
  int64_t microbatches_;
  std::map<int64_t, Stage> stages_;  // by index
  at::Device device_;
};

}  // namespace fsdp::pp

FSDP_PUBLIC_END
