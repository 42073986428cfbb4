// The reference side of the mixed-precision tests: plain LibTorch doing by hand the casts that
// fsdp::MixedPrecisionPolicy makes (an fp32 master model, a copy in param_dtype for each step's
// forward and backward, each rank's gradients cast to reduce_dtype and summed in rank order).
#pragma once

#include "tests/parity.h"

#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace fsdp::testing {

/// Parameters by name, a tied weight once (under its first name).
inline std::vector<std::pair<std::string, torch::Tensor>> unique_params(torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& kv : m.named_parameters()) {
    if (seen.insert(kv.value().unsafeGetTensorImpl()).second) out.emplace_back(kv.key(), kv.value());
  }
  return out;
}

/// The reference's gradients of one step: for every rank r in order, `compute`'s gradients of
/// loss_of(r) (zeroed before), cast to `reduce` and summed; then the sum divided by W, in `reduce`,
/// becomes `master`'s gradient in its dtype. `compute` may be `master` itself (casts inside the
/// forward). Returns each rank's loss.
template <typename LossOf>
std::vector<torch::Tensor> reference_grads(torch::nn::Module& master, torch::nn::Module& compute, int W,
                                           at::ScalarType reduce, LossOf loss_of) {
  auto m = unique_params(master), c = unique_params(compute);
  std::vector<torch::Tensor> sums(c.size()), losses;
  for (int r = 0; r < W; ++r) {
    for (auto& [name, p] : c) p.mutable_grad() = torch::Tensor();
    torch::Tensor loss = loss_of(r);
    loss.backward();
    losses.push_back(loss.detach());
    for (size_t i = 0; i < c.size(); ++i) {
      const torch::Tensor g = c[i].second.grad().to(reduce);
      sums[i] = r == 0 ? g : sums[i] + g;
    }
  }
  for (size_t i = 0; i < m.size(); ++i) m[i].second.mutable_grad() = (sums[i] / W).to(m[i].second.scalar_type());
  return losses;
}

/// Casts `master`'s values into `compute` (the step's param_dtype copy).
inline void cast_into(torch::nn::Module& compute, torch::nn::Module& master) {
  torch::NoGradGuard no_grad;
  auto m = unique_params(master), c = unique_params(compute);
  for (size_t i = 0; i < m.size(); ++i) c[i].second.copy_(m[i].second);
}

/// Runs `fn`, which must throw an error containing `text`.
template <typename Fn>
void expect_error(Fn&& fn, const std::string& text) {
  const std::string msg = error_of(fn);
  EXPECT_NE(msg.find(text), std::string::npos) << msg;
}

/// max|a - b| as a fraction of max|b|.
inline double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  const double ref = b.abs().max().item<double>();
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>() / (ref > 0 ? ref : 1);
}

/// Every shard equals this rank's rows of the master parameter: to the bit (`tol` 0) or within tol.
/// Returns the largest difference seen.
inline double expect_shards(const Rank& r, const FSDPModule& model, torch::nn::Module& master, double tol) {
  double worst = 0;
  auto want = master.named_parameters();
  const auto place = shard_places(r, model);
  for (const auto& kv : model.named_parameters()) {
    const auto [rank, world] = place.at(kv.key());
    const torch::Tensor theirs = owned_rows(want[kv.key()].detach(), rank, world);
    EXPECT_EQ(kv.value().scalar_type(), theirs.scalar_type()) << "the shards stay the master dtype: " << kv.key();
    if (theirs.numel() > 0) worst = std::max(worst, rel_diff(kv.value().detach(), theirs));
    if (tol == 0) {
      EXPECT_TRUE(torch::equal(kv.value().detach(), theirs))
          << kv.key() << " on rank " << r.rank << ": max|diff| "
          << (kv.value().detach() - theirs).abs().max().item<double>();
    } else if (theirs.numel() > 0) {
      EXPECT_LE(rel_diff(kv.value().detach(), theirs), tol) << kv.key() << " on rank " << r.rank;
    }
  }
  return worst;
}

}  // namespace fsdp::testing
