#include "optim/clip_grad_norm.h"

#include <ATen/ops/empty.h>

#include <cmath>
#include <limits>
#include <unordered_set>

namespace fsdp::optim {

double clip_grad_norm(const detail::RootHandle& model, double max_norm, double norm_type) {
  // Each sharded parameter once (a tied weight is one tensor), with how many ranks hold the same
  // rows: replicated and hybrid units count each rank's part 1/replication times in the sum.
  std::vector<std::pair<at::Tensor, int64_t>> grads;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (auto& w : model.state().groups) {
    auto unit = w.lock();
    if (!unit) continue;
    for (const auto& s : unit->slots()) {
      if (!seen.insert(s.sharded.unsafeGetTensorImpl()).second) continue;
      if (s.sharded.grad().defined()) grads.emplace_back(s.sharded.grad(), unit->replication());
    }
  }
  const bool inf = std::isinf(norm_type);
  // This rank's part: the largest |g|, or the sum of |g|^p, over its own rows (shards hold no
  // padding, so nothing is counted twice or counted at all that is not a real gradient).
  double local = 0.0;
  for (const auto& [g, replication] : grads) {
    if (g.numel() == 0) continue;
    const double n = g.norm(norm_type).item<double>();
    local = inf ? std::max(local, n) : local + std::pow(n, norm_type) / static_cast<double>(replication);
  }
  // One all-reduce carries the norm part and how many gradients each rank has: a call before any
  // backward (no gradient anywhere) is an error on every rank alike, never a silent no-op.
  at::Tensor t = at::empty({2}, at::kDouble);
  t[0] = local;
  t[1] = static_cast<double>(grads.size());
  auto& comm = model.state().comm;
  if (inf) {
    // MAX for the norm; counting with MAX still tells "none anywhere" from "some".
    comm.all_reduce(t, c10d::ReduceOp::MAX, "clip_grad_norm's all-reduce");
  } else {
    comm.all_reduce(t, c10d::ReduceOp::SUM, "clip_grad_norm's all-reduce");
  }
  TORCH_CHECK(t[1].item<double>() > 0, "fsdp::optim::clip_grad_norm (rank ", comm.rank(), " of ", comm.world_size(),
              "): no sharded parameter has a gradient on any rank. Call it after loss.backward() and before "
              "the optimizer step.");
  const double total = inf ? t[0].item<double>() : std::pow(t[0].item<double>(), 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    for (auto& g : grads) g.first.mul_(coef);
  }
  return total;
}

}  // namespace fsdp::optim
