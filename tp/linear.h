// Column- and row-parallel linear layers (Megatron-LM's ColumnParallelLinear and
// RowParallelLinear; DTensor's ColwiseParallel and RowwiseParallel): a linear layer whose weight is
// split over the T ranks of a tensor-parallel group.
//
//   fsdp::tp::Group tp(mesh);
//   fsdp::tp::ColumnParallelLinear up(tp, fsdp::tp::ColumnParallelLinearOptions(C, 4 * C));
//   fsdp::tp::RowParallelLinear down(tp, fsdp::tp::RowParallelLinearOptions(4 * C, C));
//   auto y = down(torch::gelu(up(x)));   // x, y: [B, T, C] on every rank; in between [B, T, 4C / T]
//
// A column-parallel layer holds rows [r out/T, (r + 1) out/T) of the full [out, in] weight (and
// of the bias): its output is this rank's columns of the full output. A row-parallel layer holds
// columns [r in/T, (r + 1) in/T) of the weight and the whole bias: it takes this rank's columns
// of its input, and the all-reduce of the ranks' partial products is the full output (the bias
// added once, after it). Column then row: one all-reduce forward (the row layer's) and one
// backward (the column layer's input gradient), of [..., C] elements each.
//
// Initial weights do not depend on T: each layer draws the full weight as torch::nn::Linear(in,
// out) does, from the same random stream, and keeps its part. So a seed gives one model at every
// tensor-parallel size, and the parameters are named "weight" and "bias" as torch::nn::Linear's.
#pragma once

#include "fsdp/export.h"
#include "fsdp/tensor_split.h"
#include "tp/group.h"

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <utility>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::tp {

struct ColumnParallelLinearOptions {
  ColumnParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  /// The full layer's sizes: out_features must be divisible by the group's size.
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  /// All-gather the output: every rank gets the full [..., out] (gather_from_region). False: this
  /// rank's [..., out / T], for a row-parallel layer (or a vocabulary-parallel loss) to take.
  TORCH_ARG(bool, gather_output) = false;
  /// Apply the input's conjugate: copy_to_region (identity forward, all-reduce of the input's
  /// gradient backward), or with sequence_parallel gather_from_sequence_region. Set it false on
  /// layers that share one input (q, k and v; gate and up) and apply the conjugate once, before
  /// them: their input gradients are then summed before one all-reduce.
  TORCH_ARG(bool, conjugate_input) = true;
  /// The input is split along the sequence (dimension 1 of [batch, sequence, in]) over the
  /// group: all-gathered forward, its gradient reduce-scattered backward.
  TORCH_ARG(bool, sequence_parallel) = false;
};

/// What the column- and row-parallel layers share: the group their weight is split over, their
/// parts of the weight and bias (registered as "weight" and "bias"), and the ranks holding the
/// other parts (SplitModule).
class SplitLinear : public SplitModule {
 public:
  std::vector<int> split_ranks() const override { return group.global_ranks(); }

  Group group;
  at::Tensor weight;  ///< this rank's part of the full [out, in] weight (see each layer)
  at::Tensor bias;    ///< this rank's part of the full [out] bias (see each layer); undefined without bias

 protected:
  explicit SplitLinear(Group group) : group(std::move(group)) {}
};

/// weight: [out / T, in], rows [r out/T, (r + 1) out/T) of the full weight; bias: [out / T].
class ColumnParallelLinearImpl : public torch::nn::Cloneable<ColumnParallelLinearImpl>, public SplitLinear {
 public:
  ColumnParallelLinearImpl(Group group, ColumnParallelLinearOptions options);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  /// [..., in] -> [..., out / T] (or [..., out] with gather_output).
  at::Tensor forward(const at::Tensor& input);
  /// weight and bias: split along dimension 0.
  std::vector<std::pair<std::string, TensorSplit>> parameter_splits() const override;

  ColumnParallelLinearOptions options;
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelLinearOptions {
  RowParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  /// The full layer's sizes: in_features must be divisible by the group's size.
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  /// The input is this rank's columns already (a column-parallel layer's output). False: the
  /// full input, of which the layer takes this rank's columns (scatter_to_region).
  TORCH_ARG(bool, input_is_parallel) = true;
  /// Reduce-scatter the output along the sequence (dimension 1) instead of all-reducing it: each
  /// rank gets its part of the sequence, for sequence-parallel norms. The bias, added after, then
  /// gets its gradient from this rank's part of the sequence only: it is all-reduced over the
  /// group in backward (copy_to_region applied to the bias), so that every rank's is the full one.
  TORCH_ARG(bool, sequence_parallel) = false;
};

/// weight: [out, in / T], columns [r in/T, (r + 1) in/T) of the full weight; bias: [out], whole
/// on every rank.
class RowParallelLinearImpl : public torch::nn::Cloneable<RowParallelLinearImpl>, public SplitLinear {
 public:
  RowParallelLinearImpl(Group group, RowParallelLinearOptions options);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  /// [..., in / T] (or [..., in] without input_is_parallel) -> [..., out] (or [batch, sequence /
  /// T, out] with sequence_parallel).
  at::Tensor forward(const at::Tensor& input);
  /// weight: split along dimension 1; bias: not split.
  std::vector<std::pair<std::string, TensorSplit>> parameter_splits() const override;

  RowParallelLinearOptions options;
};
TORCH_MODULE(RowParallelLinear);

}  // namespace fsdp::tp

FSDP_PUBLIC_END
