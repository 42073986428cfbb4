// A unit's buffers: each parameter's slot (its shard, its full view, the gradient waiting aside),
// the flat shard that holds this rank's rows of every parameter, the unsharded buffer whose storage
// exists only while the unit is gathered, and the aliasing that ties the user's parameters to
// them. With CPU offload the flat shard is in host memory (unit_config.cpp: host_options).
#pragma once

#include "fsdp/error.h"
#include "fsdp/shard_layout.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

/// Where one parameter lives in its unit, sharded over S ranks (the world, a hybrid group, or 1
/// when replicated) by the row layout of fsdp/shard_layout.h.
struct ParamSlot {
  std::string name;  ///< fully qualified name in the root module
  /// The user's parameter (the module's own tensor): between steps it points at `sharded` and its
  /// .grad is the sharded gradient (what an optimizer on model->parameters() updates); while its
  /// unit is unsharded (forward, backward) it points at `unsharded` and its .grad is the full one.
  at::Tensor param;
  at::Tensor sharded;    ///< this rank's rows (a plain alias of the unit's shard memory)
  at::Tensor unsharded;  ///< the full view `param` points at while unsharded
  /// Where the gradient of the other shape waits: the sharded gradient while `param` is full
  /// (forward, backward), the full gradient (accumulated without sync, or ZeRO-1's) while `param`
  /// is its shard.
  at::Tensor shard_grad, full_grad;
  std::vector<int64_t> shape;
  RowLayout layout;        ///< its rows over the unit's shard ranks (fsdp/shard_layout.h)
  int64_t local_rows = 0;  ///< rows this rank holds: layout.local_rows(shard rank)
  int64_t offset = 0;      ///< start of this parameter's c rows in the flat shard
  int64_t padded_numel() const { return layout.padded_numel(); }
  bool requires_grad = false;
  bool grad_ready = false;
  /// Kept alive on purpose: autograd holds a parameter's AccumulateGrad node only weakly, and a
  /// re-created node would have neither our hook nor the full shape it must validate against.
  std::shared_ptr<torch::autograd::Node> grad_accumulator;
  /// Mixed precision without gradient sync: the micro-batches' full gradients summed in the master
  /// dtype (each backward's param_dtype gradient is added here as it ends), until a backward with
  /// sync reduces them.
  at::Tensor unsynced;
};

/// The sharded gradient of a slot (on the parameter between steps, aside while it is full) and
/// the full one (on the parameter while it is full, aside otherwise).
inline at::Tensor& shard_grad_of(ParamSlot& s, bool full_views) {
  return full_views ? s.shard_grad : s.param.mutable_grad();
}
inline const at::Tensor& shard_grad_of(const ParamSlot& s, bool full_views) {
  return full_views ? s.shard_grad : s.param.grad();
}
inline at::Tensor& full_grad_of(ParamSlot& s, bool full_views) {
  return full_views ? s.param.mutable_grad() : s.full_grad;
}
inline const at::Tensor& full_grad_of(const ParamSlot& s, bool full_views) {
  return full_views ? s.param.grad() : s.full_grad;
}

/// How a unit keeps its parameters.
enum class BufferKind {
  kShards,      ///< a flat shard, and an unsharded buffer with memory only while gathered
  kWhole,       ///< replicated, or sharded over one rank: the flat shard is the whole unit and
                ///< the parameters' storage
  kRowsOfFull,  ///< ZeRO-1: full parameters kept; the shards are this rank's rows of them
};

struct UnitBuffers {
  int64_t shard_numel = 0;  ///< elements of the flat shard, padding included
  at::Tensor flat_shard;    ///< [shard_numel] (undefined for kRowsOfFull)
  at::Tensor unsharded;     ///< [S * shard_numel], rank-major per parameter
};

/// Lays the slots out over S ranks (this rank is r): each slot's layout, rows and flat offset.
/// Returns the flat shard's size.
int64_t lay_out(std::vector<ParamSlot>& slots, int64_t S, int64_t r);

/// For slots laid out (above): copies this rank's rows of each parameter into the flat shard (or
/// keeps the full parameters), points each parameter at its full view and fills the slots' views.
/// The parameters' own storage is released. The flat shard has `opts` (the master weights' dtype;
/// pinned host memory with CPU offload), the unsharded buffer `full_opts` (the model's device,
/// mixed precision's param_dtype; kShards only).
UnitBuffers make_buffers(std::vector<ParamSlot>& slots, int64_t shard_numel, int64_t S, int64_t r, BufferKind kind,
                         const at::TensorOptions& opts, const at::TensorOptions& full_opts);

/// Lends `block`'s memory to `t`'s storage (which must have none), the whole of it; every view of
/// the storage sees it. The caller keeps `block` alive until take_memory_back(t).
void lend_memory(const at::Tensor& t, const at::Tensor& block);
/// Leaves `t`'s storage without memory again (0 bytes); `block` may then be reused.
void take_memory_back(const at::Tensor& t);

/// A tensor of `shape` over `base`'s storage from `offset` elements on: not an autograd view
/// (optimizers call detach_() on gradients, which is illegal on views).
at::Tensor alias_rows(const at::Tensor& base, int64_t offset, at::IntArrayRef shape);

/// Rows [first, first + n) of a contiguous tensor with `row_numel` elements per row, flattened.
at::Tensor flat_rows(const at::Tensor& t, int64_t first, int64_t n, int64_t row_numel);

/// Points the parameters at their full views, moving each sharded gradient aside and putting the
/// full one (if any) on the parameter; point_at_shards does the reverse. Only pointers move. With
/// mixed precision the two have different dtypes, and set_data to another dtype makes autograd
/// drop the parameter's AccumulateGrad (a new one would have neither the library's hook nor the
/// full shape): point_at_full_views gives it back the slot's own.
void point_at_full_views(std::vector<ParamSlot>& slots);
void point_at_shards(std::vector<ParamSlot>& slots);

/// Between steps: each parameter whose storage was replaced (torch::load uses set_) has its values
/// copied into its shard and is pointed back at it; another shape, dtype or device is refused,
/// naming `rank`, the parameter and `unit`. Returns whether any was replaced.
bool adopt_replaced(std::vector<ParamSlot>& slots, int64_t shard_rank, const ErrorContext& context,
                    const std::string& unit);

/// Whether a tensor on `actual` is on `wanted` (a device without index, such as torch::kCUDA,
/// matches every device of its type).
bool is_on(const at::Device& actual, const at::Device& wanted);

/// Refuses a conversion of the parameters to another dtype or device after wrapping.
void check_conversion(const std::vector<ParamSlot>& slots, const std::optional<at::Device>& device,
                      const std::optional<at::ScalarType>& dtype, const ErrorContext& context, const std::string& unit,
                      bool converting);

/// The sharded gradients as one flat buffer in the flat shard's layout, when every parameter with
/// elements has its gradient there at its offset; undefined otherwise.
at::Tensor flat_grad(const std::vector<ParamSlot>& slots, const at::Tensor& flat_shard, int64_t shard_numel,
                     bool full_views);

}  // namespace fsdp::detail
