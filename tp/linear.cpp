#include "tp/linear.h"

#include "fsdp/internal/check.h"
#include "tp/conjugates.h"

#include <ATen/autocast_mode.h>
#include <ATen/ops/linear.h>
#include <torch/nn/modules/linear.h>

namespace fsdp::tp {
namespace {

// The full torch::nn::Linear(in, out) drawn from the current random stream, as every rank draws
// it: the layer keeps its part, so its values do not depend on the tensor-parallel size.
torch::nn::Linear full_linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

/// The input and the weight of one dtype, or autocast on for the input's device (it casts both,
/// as for torch::nn::Linear).
bool same_dtype_or_autocast(const at::Tensor& input, const at::Tensor& weight) {
  return input.scalar_type() == weight.scalar_type() || at::autocast::is_autocast_enabled(input.device().type());
}

void check_split(const Group& g, const char* layer, const char* what, int64_t n, int64_t in, int64_t out) {
  FSDP_CHECK(in > 0 && out > 0, "fsdp::tp::", layer, " on ", g.where(), ": sizes must be positive, not in ", in,
             ", out ", out, ".");
  FSDP_CHECK(n % g.size() == 0, "fsdp::tp::", layer, "(in ", in, ", out ", out, ") on ", g.where(), ": its ", what,
             " (", n, ") is not divisible by the ", g.size(),
             " tensor-parallel ranks. Choose a tensor-parallel size "
             "that divides ",
             n, ", or pad the layer.");
}

}  // namespace

ColumnParallelLinearImpl::ColumnParallelLinearImpl(Group group, ColumnParallelLinearOptions options)
    : SplitLinear(std::move(group)), options(options) {
  ColumnParallelLinearImpl::reset();  // qualified: called from the constructor
}

void ColumnParallelLinearImpl::reset() {
  const int64_t in = options.in_features(), out = options.out_features();
  check_split(group, "ColumnParallelLinear", "output features", out, in, out);
  const int64_t n = out / group.size();
  auto full = full_linear(in, out, options.bias());
  weight = register_parameter("weight", full->weight.detach().narrow(0, group.rank() * n, n).clone());
  if (options.bias()) {
    bias = register_parameter("bias", full->bias.detach().narrow(0, group.rank() * n, n).clone());
  } else {
    bias = at::Tensor();
  }
}

void ColumnParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "fsdp::tp::ColumnParallelLinear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha << options.bias()
         << ", part=" << group.rank() << "/" << group.size() << ")";
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  FSDP_CHECK(input.dim() >= 1 && input.size(-1) == options.in_features(), "fsdp::tp::ColumnParallelLinear(in ",
             options.in_features(), ", out ", options.out_features(), ") on ", group.where(),
             ": its input's last dimension must be ", options.in_features(), ", but the input has shape ",
             input.sizes(), ".");
  FSDP_CHECK(same_dtype_or_autocast(input, weight), "fsdp::tp::ColumnParallelLinear(in ", options.in_features(),
             ", out ", options.out_features(), ") on ", group.where(), ": the input is ", input.scalar_type(),
             " but the weight is ", weight.scalar_type(), "; convert one (module->to(dtype), or the input).");
  FSDP_CHECK(!options.sequence_parallel() || !options.conjugate_input() || input.dim() >= 3,
             "fsdp::tp::ColumnParallelLinear(in ", options.in_features(), ", out ", options.out_features(), ") on ",
             group.where(),
             ": sequence_parallel takes [batch, sequence / T, in] inputs, split along dimension 1, "
             "but the input has shape ",
             input.sizes(), ".");
  at::Tensor x = input;
  if (options.conjugate_input()) {
    x = options.sequence_parallel() ? gather_from_sequence_region(x, group, 1) : copy_to_region(x, group);
  }
  at::Tensor y = at::linear(x, weight, bias);
  return options.gather_output() ? gather_from_region(y, group) : y;
}

std::vector<std::pair<std::string, TensorSplit>> ColumnParallelLinearImpl::parameter_splits() const {
  std::vector<std::pair<std::string, TensorSplit>> out{{"weight", TensorSplit{0, group.rank(), group.size()}}};
  if (bias.defined()) out.emplace_back("bias", TensorSplit{0, group.rank(), group.size()});
  return out;
}

RowParallelLinearImpl::RowParallelLinearImpl(Group group, RowParallelLinearOptions options)
    : SplitLinear(std::move(group)), options(options) {
  RowParallelLinearImpl::reset();  // qualified: called from the constructor
}

void RowParallelLinearImpl::reset() {
  const int64_t in = options.in_features(), out = options.out_features();
  check_split(group, "RowParallelLinear", "input features", in, in, out);
  const int64_t n = in / group.size();
  auto full = full_linear(in, out, options.bias());
  weight = register_parameter("weight", full->weight.detach().narrow(1, group.rank() * n, n).clone());
  if (options.bias()) {
    bias = register_parameter("bias", full->bias.detach().clone());
  } else {
    bias = at::Tensor();
  }
}

void RowParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "fsdp::tp::RowParallelLinear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha << options.bias()
         << ", part=" << group.rank() << "/" << group.size() << ")";
}

std::vector<std::pair<std::string, TensorSplit>> RowParallelLinearImpl::parameter_splits() const {
  std::vector<std::pair<std::string, TensorSplit>> out{{"weight", TensorSplit{1, group.rank(), group.size()}}};
  if (bias.defined()) out.emplace_back("bias", TensorSplit{});
  return out;
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  const int64_t in = options.input_is_parallel() ? options.in_features() / group.size() : options.in_features();
  FSDP_CHECK(input.dim() >= 1 && input.size(-1) == in, "fsdp::tp::RowParallelLinear(in ", options.in_features(),
             ", out ", options.out_features(), ") on ", group.where(), ": its input's last dimension must be ", in,
             options.input_is_parallel() ? " (this rank's columns: in / tensor-parallel size)" : "",
             ", but the input has shape ", input.sizes(), ".");
  FSDP_CHECK(same_dtype_or_autocast(input, weight), "fsdp::tp::RowParallelLinear(in ", options.in_features(), ", out ",
             options.out_features(), ") on ", group.where(), ": the input is ", input.scalar_type(),
             " but the weight is ", weight.scalar_type(), "; convert one (module->to(dtype), or the input).");
  FSDP_CHECK(!options.sequence_parallel() || (input.dim() >= 3 && input.size(1) % group.size() == 0),
             "fsdp::tp::RowParallelLinear(in ", options.in_features(), ", out ", options.out_features(), ") on ",
             group.where(), ": sequence_parallel reduce-scatters its output along the sequence, dimension 1 of a ",
             "[batch, sequence, in / T] input, which the ", group.size(),
             " tensor-parallel ranks must divide; the input has shape ", input.sizes(), ".");
  at::Tensor x = options.input_is_parallel() ? input : scatter_to_region(input, group);
  at::Tensor partial = at::linear(x, weight);
  at::Tensor y = options.sequence_parallel() ? reduce_scatter_to_sequence_region(partial, group, 1)
                                             : reduce_from_region(partial, group);
  if (!bias.defined()) return y;
  // Under sequence parallelism each rank's output rows are its part of the sequence, so the bias
  // gradient is partial: f on the bias sums it over the group in backward.
  return y + (options.sequence_parallel() ? copy_to_region(bias, group) : bias);
}

}  // namespace fsdp::tp
