#include "optim/clip_grad_norm.h"

#include <ATen/ops/empty.h>

#include <cmath>
#include <limits>

namespace fsdp::optim {

double clip_grad_norm(const detail::RootHandle& model, double max_norm, double norm_type) {
  std::vector<at::Tensor> grads;
  for (const auto& p : model.sharded_parameters()) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  const bool inf = std::isinf(norm_type);
  // This rank's part: the largest |g|, or the sum of |g|^p, over its own rows (shards hold no
  // padding, so nothing is counted twice or counted at all that is not a real gradient).
  double local = 0.0;
  for (const auto& g : grads) {
    if (g.numel() == 0) continue;
    const double n = g.norm(norm_type).item<double>();
    local = inf ? std::max(local, n) : local + std::pow(n, norm_type);
  }
  at::Tensor t = at::empty({1}, at::kDouble);
  t.fill_(local);
  model.state().comm.all_reduce(t, inf ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM, "clip_grad_norm's all-reduce");
  const double total = inf ? t.item<double>() : std::pow(t.item<double>(), 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    for (auto& g : grads) g.mul_(coef);
  }
  return total;
}

}  // namespace fsdp::optim
