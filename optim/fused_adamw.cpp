#include "optim/fused_adamw.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"

#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/strides.h>

namespace fsdp::optim {
namespace {

at::Tensor alias(const at::Tensor& base, int64_t offset, at::IntArrayRef shape) {
  at::Tensor t = at::empty({0}, base.options());
  t.set_(base.storage(), base.storage_offset() + offset, shape, c10::contiguous_strides(shape));
  return t;
}

bool aliases(const at::Tensor& t, const at::Tensor& view) {
  return t.defined() && t.is_alias_of(view) && t.storage_offset() == view.storage_offset() && t.sizes() == view.sizes();
}

}  // namespace

FusedAdamW::FusedAdamW(const FSDPModule& model, const torch::optim::AdamWOptions& options)
    : AdamW(model.parameters(), options), model_(model) {
  FSDP_CHECK(!options.amsgrad(), "fsdp::optim::FusedAdamW: amsgrad is not supported; use torch::optim::AdamW");
}

torch::optim::AdamWParamState& FusedAdamW::param_state(const ShardSpec& p, size_t unit) {
  const Moments& m = moments_[unit];
  const at::Tensor exp_avg = alias(m.exp_avg, p.flat_offset, p.local.sizes());
  const at::Tensor exp_avg_sq = alias(m.exp_avg_sq, p.flat_offset, p.local.sizes());
  auto& slot = state_[p.local.unsafeGetTensorImpl()];
  if (!slot) {
    auto st = std::make_unique<torch::optim::AdamWParamState>();
    st->step(0);
    st->exp_avg(exp_avg);
    st->exp_avg_sq(exp_avg_sq);
    slot = std::move(st);
  }
  auto& st = static_cast<torch::optim::AdamWParamState&>(*slot);
  // Loaded (torch::load of the optimizer) or otherwise replaced: into the flat buffers.
  for (auto [mine, flat] : {std::pair{st.exp_avg(), exp_avg}, std::pair{st.exp_avg_sq(), exp_avg_sq}}) {
    if (aliases(mine, flat)) continue;
    FSDP_CHECK_IN(ErrorContext().api("fsdp::optim::FusedAdamW").rank(model_.rank()).world_size(model_.world_size()),
                  mine.sizes() == flat.sizes(), "the loaded state of parameter '", p.name, "' has shape ", mine.sizes(),
                  ", but this rank's rows of it are ", flat.sizes(),
                  ". Load the optimizer state this rank saved from the same wrapped model and world size.");
    flat.copy_(mine);
  }
  st.exp_avg(exp_avg);
  st.exp_avg_sq(exp_avg_sq);
  return st;
}

at::Tensor FusedAdamW::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode grad(true);
    loss = closure();
  }
  fsdp::detail::check_gradients_reduced(model_, "fsdp::optim::FusedAdamW::step");
  const auto& o = static_cast<const torch::optim::AdamWOptions&>(param_groups()[0].options());
  const std::vector<ShardSpec> specs = model_.shard_specs();
  const std::vector<UnitInfo> units = model_.units();
  moments_.resize(units.size());
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  bool any_grad = false;
  for (size_t k = 0; k < units.size(); ++k) {
    const UnitInfo& u = units[k];
    if (u.shard_numel == 0) continue;
    const auto opts = specs[u.specs.front()].local.options().requires_grad(false);
    if (!moments_[k].exp_avg.defined()) {
      moments_[k].exp_avg = at::zeros({u.shard_numel}, opts);
      moments_[k].exp_avg_sq = at::zeros({u.shard_numel}, opts);
    }
    // One flat update when every gradient is where the reduce-scatter put it and every parameter
    // has stepped equally so far (the flat buffer's padding then stays 0).
    std::vector<torch::optim::AdamWParamState*> state;
    bool whole = u.flat_shard.defined() && u.flat_grad.defined();
    for (size_t i : u.specs) {
      auto* st = &param_state(specs[i], k);
      state.push_back(st);
      whole = whole && st->step() == state.front()->step();
    }
    if (whole) {
      const int64_t n = state.front()->step() + 1;
      for (auto* st : state) st->step(n);
      params.push_back(u.flat_shard);
      grads.push_back(u.flat_grad);
      exp_avgs.push_back(moments_[k].exp_avg);
      exp_avg_sqs.push_back(moments_[k].exp_avg_sq);
      steps.push_back(at::full({}, static_cast<double>(n), opts.dtype(at::kFloat)));
      any_grad = true;
      continue;
    }
    for (size_t j = 0; j < u.specs.size(); ++j) {
      const ShardSpec& p = specs[u.specs[j]];
      if (!p.local.grad().defined()) continue;
      auto* st = state[j];
      st->step(st->step() + 1);  // also for a rank's empty shard, so step counts stay equal
      any_grad = true;
      if (p.local.numel() == 0) continue;
      params.push_back(p.local);
      grads.push_back(p.local.grad());
      exp_avgs.push_back(st->exp_avg());
      exp_avg_sqs.push_back(st->exp_avg_sq());
      steps.push_back(at::full({}, static_cast<double>(st->step()), opts.dtype(at::kFloat)));
    }
  }
  tensors_last_step_ = params.size();
  FSDP_CHECK(any_grad || units.empty(),
             "fsdp::optim::FusedAdamW::step: no sharded parameter has a gradient. Call step() after "
             "loss.backward() (and zero_grad() after step()).");
  if (!params.empty()) {
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, o.lr(),
                      std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(),
                      /*amsgrad=*/false, /*maximize=*/false);
  }
  return loss;
}

}  // namespace fsdp::optim
