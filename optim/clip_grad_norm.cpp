#include "optim/clip_grad_norm.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"
#include "fsdp/process_group.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>

namespace fsdp::optim {
namespace {

/// One sharded gradient: how many ranks hold the same rows (replicated and hybrid units, and
/// parameters tensor parallelism does not split, count each rank's part 1/replicas times in the
/// sum), and its parameter's name, for messages.
struct ShardGrad {
  at::Tensor grad;
  int64_t replicas;
  std::string name;
};

/// The model's part of the norm over its own ranks, in one all-reduce: [the sum of |g|^p (inf:
/// the largest |g|), the gradients counted, whether any is not finite]. Fills `grads` with this
/// rank's gradients (for clipping), those named in `skip` left out of the sum (not of `grads`).
at::Tensor model_norm_part(const FSDPModule& model, double norm_type, const char* caller, std::vector<ShardGrad>& grads,
                           const std::vector<std::string>& skip) {
  fsdp::detail::check_gradients_reduced(model, caller);
  // While replicas train apart (LocalSGD, DiLoCo) the norm is each replica's: the sum spans its
  // shard group only, where no other rank holds the same rows.
  const bool per_replica = fsdp::detail::replicas_apart(model);
  std::vector<bool> counted;
  for (const auto& p : model.shard_specs()) {  // each parameter once (a tied weight is one tensor)
    // A parameter tensor parallelism does not split is the same on each of the tp_size ranks:
    // counted once over them, as a replica is.
    const int64_t copies = static_cast<int64_t>(per_replica ? 1 : p.replicas) * (p.tp.split() ? 1 : p.tp_size);
    if (!p.local.grad().defined()) continue;
    grads.push_back({p.local.grad(), copies, p.name});
    counted.push_back(std::find(skip.begin(), skip.end(), p.name) == skip.end());
  }
  const bool inf = std::isinf(norm_type);
  // This rank's part: the largest |g|, or the sum of |g|^p, over its own rows (shards hold no
  // padding, so nothing is counted twice or counted at all that is not a real gradient). A NaN
  // is kept (std::max would drop it) and also flagged, since a MAX reduction may drop it too.
  double local = 0.0;
  bool nonfinite = false;
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& g = grads[i];
    if (g.grad.numel() == 0 || !counted[i]) continue;
    const double n = g.grad.norm(norm_type).item<double>();
    nonfinite = nonfinite || !std::isfinite(n);
    if (!inf) {
      local += std::pow(n, norm_type) / static_cast<double>(g.replicas);
    } else if (std::isnan(n) || std::isnan(local)) {
      local = std::numeric_limits<double>::quiet_NaN();
    } else {
      local = std::max(local, n);
    }
  }
  // One all-reduce carries the norm part, how many gradients each rank has (a call before any
  // backward, no gradient anywhere, is an error on every rank alike, never a silent no-op) and
  // whether any rank saw a non-finite part.
  at::Tensor t = at::empty({3}, at::kDouble);
  t[0] = local;
  t[1] = static_cast<double>(grads.size());
  t[2] = nonfinite ? 1.0 : 0.0;
  // MAX for the inf norm; counting with MAX still tells "none anywhere" from "some". Every rank
  // must be here (the model checks that first).
  std::ostringstream call;
  call << caller << " (norm_type " << norm_type << ")";
  fsdp::detail::all_reduce(model, t, inf ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM, call.str());
  return t;
}

/// The norm from the reduced parts `t` (model_norm_part's, summed or maxed over whatever spans
/// the whole model), with its checks: some gradient somewhere, and with `error_if_nonfinite` a
/// finite norm (else the error names this rank's first parameter whose gradient is not).
double norm_of(const at::Tensor& t, const FSDPModule& model, double norm_type, bool error_if_nonfinite,
               const char* caller, const std::vector<ShardGrad>& grads) {
  const bool inf = std::isinf(norm_type);
  const ErrorContext context =
      ErrorContext().api(caller).rank(model.rank()).world_size(model.world_size()).operation(caller);
  FSDP_CHECK_IN(context, t[1].item<double>() > 0,
                "no sharded parameter has a gradient on any rank. Call it after loss.backward() and before "
                "the optimizer step.");
  double total = inf ? t[0].item<double>() : std::pow(t[0].item<double>(), 1.0 / norm_type);
  if (t[2].item<double>() > 0 && std::isfinite(total)) total = std::numeric_limits<double>::quiet_NaN();
  if (error_if_nonfinite && !std::isfinite(total)) {
    // Every rank has the same `total`, so every rank throws here; each names what it holds.
    std::ostringstream mine;
    for (const auto& g : grads) {
      if (g.grad.numel() > 0 && !g.grad.isfinite().all().item<bool>()) {
        mine << "this rank's first parameter with a non-finite gradient is '" << g.name << "'";
        break;
      }
    }
    if (mine.tellp() == 0) {
      mine << "every gradient on this rank is finite (the non-finite values are on another rank, or the sum of "
              "their powers overflowed)";
    }
    FSDP_CHECK_IN(context, false, "the total gradient norm (norm_type ", norm_type, ") is ", total, ", not finite; ",
                  mine.str(),
                  ". Training has diverged or the data holds bad values: lower the learning rate, check the input "
                  "data, or clip the gradients (a smaller max_norm); error_if_nonfinite=false returns the norm "
                  "instead of throwing.");
  }
  return total;
}

/// The global `norm_type` norm of every sharded gradient of `model`, in one all-reduce; fills
/// `grads` with this rank's gradients (for clipping). `caller` names the function in errors.
double global_norm(const FSDPModule& model, double norm_type, bool error_if_nonfinite, const char* caller,
                   std::vector<ShardGrad>& grads) {
  const at::Tensor t = model_norm_part(model, norm_type, caller, grads, {});
  return norm_of(t, model, norm_type, error_if_nonfinite, caller, grads);
}

}  // namespace

double clip_grad_norm(const std::vector<FSDPModule>& models, const c10::intrusive_ptr<c10d::ProcessGroup>& pipeline,
                      double max_norm, const std::vector<std::string>& skip, double norm_type,
                      bool error_if_nonfinite) {
  const char* const caller = "fsdp::optim::clip_grad_norm (pipeline stages)";
  FSDP_CHECK(!models.empty(), caller, ": no model: pass this rank's stages, each wrapped by fsdp::fully_shard");
  FSDP_CHECK(pipeline, caller, ": the pipeline's process group is null");
  const bool inf = std::isinf(norm_type);
  std::vector<std::vector<ShardGrad>> grads(models.size());
  at::Tensor t = at::zeros({3}, at::kDouble);
  for (size_t i = 0; i < models.size(); ++i) {  // each over its own stage's ranks
    const at::Tensor part = model_norm_part(models[i], norm_type, caller, grads[i], skip);
    t[0] = inf ? std::max(t[0].item<double>(), part[0].item<double>()) : t[0].item<double>() + part[0].item<double>();
    t[1] += part[1];
    t[2] += part[2];
  }
  fsdp::all_reduce(pipeline, t, inf ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM);  // then over the stages
  std::vector<ShardGrad> all;
  for (const auto& g : grads) all.insert(all.end(), g.begin(), g.end());
  const double total = norm_of(t, models.front(), norm_type, error_if_nonfinite, caller, all);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0)
    for (auto& g : all) g.grad.mul_(coef);
  // The gradients as this call found them, and its clipping, are the pipeline's: a tied weight's
  // copies summed in place before it (on the first and the last stage), not the per-rank habit
  // FSDP's check warns about.
  for (const auto& m : models) fsdp::detail::gradients_rescaled(m);
  return total;
}

double clip_grad_norm(const FSDPModule& model, double max_norm, double norm_type, bool error_if_nonfinite) {
  std::vector<ShardGrad> grads;
  const double total = global_norm(model, norm_type, error_if_nonfinite, "fsdp::optim::clip_grad_norm", grads);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    for (auto& g : grads) g.grad.mul_(coef);
    fsdp::detail::gradients_rescaled(model);  // by the global norm: not the per-rank habit warned about
  }
  return total;
}

double grad_norm(const FSDPModule& model, double norm_type, bool error_if_nonfinite) {
  std::vector<ShardGrad> grads;
  return global_norm(model, norm_type, error_if_nonfinite, "fsdp::optim::grad_norm", grads);
}

}  // namespace fsdp::optim
