#include "tp/cross_entropy.h"

#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"

#include <torch/autograd.h>

#include <sstream>

namespace fsdp::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::string tokens_text(int64_t n, const char* what) {
  std::ostringstream os;
  os << "vocab-parallel cross-entropy forward: all-reduce of the " << what << " of " << n << " token(s)";
  return os.str();
}

// Per token: -log softmax(logits)[target] over the whole vocabulary (0 where ignored), in fp32.
struct VocabParallelCE : torch::autograd::Function<VocabParallelCE> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets, const Group& g,
                            int64_t ignore_index) {
    detail::Comm& comm = detail::tp_comm(g);
    const int64_t v = logits.size(-1);
    const int64_t begin = g.rank() * v;
    at::Tensor x = logits.reshape({-1, v}).to(at::kFloat);
    at::Tensor t = targets.reshape({-1});
    const int64_t n = x.size(0);
    at::Tensor ignored = t.eq(ignore_index);
    at::Tensor mine = t.ge(begin).logical_and(t.lt(begin + v)).logical_and(ignored.logical_not());
    at::Tensor local_t = (t - begin).masked_fill(mine.logical_not(), 0);

    at::Tensor m = std::get<0>(x.max(-1)).contiguous();
    comm.all_reduce(m, c10d::ReduceOp::MAX, tokens_text(n, "maximum logit"));
    at::Tensor shifted = x - m.unsqueeze(-1);
    at::Tensor target_logit = (shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * mine).contiguous();
    comm.all_reduce(target_logit, c10d::ReduceOp::SUM, tokens_text(n, "target logit"));
    at::Tensor e = shifted.exp();
    at::Tensor sum = e.sum(-1).contiguous();
    comm.all_reduce(sum, c10d::ReduceOp::SUM, tokens_text(n, "sum of exponentials"));
    at::Tensor loss = (sum.log() - target_logit).masked_fill(ignored, 0);

    e.div_(sum.unsqueeze(-1));  // this rank's columns of the softmax
    ctx->save_for_backward({e, local_t, mine, ignored});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    ctx->saved_data["shape"] = logits.sizes().vec();
    return loss.view(targets.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();
    const at::Tensor& local_t = saved[1];
    const at::Tensor& mine = saved[2];
    const at::Tensor& ignored = saved[3];
    grad.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(grad.scalar_type()).unsqueeze(-1));
    at::Tensor g = grads[0].reshape({-1}).to(at::kFloat).masked_fill(ignored, 0);
    grad.mul_(g.unsqueeze(-1));
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype).view(ctx->saved_data["shape"].toIntVector()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets, const Group& group,
                                        const VocabParallelCrossEntropyOptions& options) {
  const char* fn = "fsdp::tp::vocab_parallel_cross_entropy";
  FSDP_CHECK(local_logits.dim() >= 1 && local_logits.dim() == targets.dim() + 1 &&
                 local_logits.sizes().slice(0, targets.dim()) == targets.sizes(),
             fn, " on ", group.where(),
             ": the logits ([..., V / T]) must have the targets' shape ([...]) plus the "
             "vocabulary, but the logits have shape ",
             local_logits.sizes(), " and the targets ", targets.sizes(), ".");
  FSDP_CHECK(at::isFloatingType(local_logits.scalar_type()), fn, " on ", group.where(),
             ": the logits must be floating point, not ", local_logits.scalar_type(), ".");
  FSDP_CHECK(!at::isFloatingType(targets.scalar_type()) && !targets.is_complex(), fn, " on ", group.where(),
             ": the targets must be integers (class indices), not ", targets.scalar_type(), ".");
  const int64_t V = local_logits.size(-1) * group.size();
  at::Tensor t = targets.to(at::kLong);
  if (t.is_cpu() && t.numel() > 0) {
    // A target outside the vocabulary would count as a zero target logit: refused, as torch refuses it.
    at::Tensor bad = t.ne(options.ignore_index()).logical_and(t.lt(0).logical_or(t.ge(V)));
    if (bad.any().item<bool>()) {
      const int64_t first = t.masked_select(bad)[0].item<int64_t>();
      FSDP_CHECK(false, fn, " on ", group.where(), ": target ", first, " is outside the vocabulary [0, ", V,
                 ") (the logits' ", local_logits.size(-1), " columns on each of ", group.size(),
                 " tensor-parallel ranks), and is not ignore_index (", options.ignore_index(), ").");
    }
  }
  at::Tensor per_token = VocabParallelCE::apply(local_logits, t, group, options.ignore_index());
  at::Tensor counted = t.ne(options.ignore_index()).sum().to(at::kFloat);
  return (per_token.sum() / counted).to(local_logits.scalar_type());
}

}  // namespace fsdp::tp
