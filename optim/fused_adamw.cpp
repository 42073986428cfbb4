#include "optim/fused_adamw.h"

#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/zeros.h>
#include <c10/util/strides.h>

namespace fsdp::optim {
namespace {

at::Tensor alias(const at::Tensor& base, int64_t offset, at::IntArrayRef shape) {
  at::Tensor t = at::empty({0}, base.options());
  t.set_(base.storage(), base.storage_offset() + offset, shape, c10::contiguous_strides(shape));
  return t;
}

}  // namespace

FusedAdamW::FusedAdamW(const detail::RootHandle& model, const torch::optim::AdamWOptions& options)
    : Optimizer({torch::optim::OptimizerParamGroup(model.sharded_parameters())},
                std::make_unique<torch::optim::AdamWOptions>(options)) {
  TORCH_CHECK(!options.amsgrad(), "fsdp::optim::FusedAdamW: amsgrad is not supported; use torch::optim::AdamW");
  for (auto& w : model.state().groups) {
    if (auto g = w.lock()) units_.push_back(UnitState{g, {}, {}, {}});
  }
}

at::Tensor FusedAdamW::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode grad(true);
    loss = closure();
  }
  if (!units_.empty()) {
    if (auto g = units_.front().group.lock()) g->state().check_no_unsynced_grads("fsdp::optim::FusedAdamW::step");
  }
  const auto& o = static_cast<const torch::optim::AdamWOptions&>(param_groups()[0].options());
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  for (auto& u : units_) {
    auto g = u.group.lock();
    if (!g || g->shard_numel() == 0) continue;
    const auto& slots = g->slots();
    // kShardOptimizerState has no flat shard (its shards are slices of the full parameters): it
    // is updated per parameter.
    const at::Tensor& flat = g->flat_shard();
    const auto opts = slots.front().sharded.options().requires_grad(false);
    if (!u.exp_avg.defined()) {
      u.exp_avg = at::zeros({g->shard_numel()}, opts);
      u.exp_avg_sq = at::zeros({g->shard_numel()}, opts);
      for (size_t i = 0; i < slots.size(); ++i) u.steps.push_back(at::zeros({}, opts.dtype(at::kFloat)));
      u.counts.assign(slots.size(), 0);
    }
    // One flat update when every parameter's gradient is where the reduce-scatter put it: one
    // buffer, each at its parameter's offset, and every parameter has stepped equally so far.
    bool whole = flat.defined();
    at::Tensor first_grad;
    for (size_t i = 0; i < slots.size() && whole; ++i) {
      const auto& s = slots[i];
      const at::Tensor& gr = g->shard_grad(s);
      if (!gr.defined()) {
        whole = s.padded_numel() == 0;
        continue;
      }
      if (!first_grad.defined()) first_grad = gr;
      whole = gr.storage().unsafeGetStorageImpl() == first_grad.storage().unsafeGetStorageImpl() &&
              gr.storage_offset() == s.offset && gr.is_contiguous() && u.counts[i] == u.counts[0];
    }
    whole = whole && first_grad.defined() &&
            first_grad.storage().nbytes() == static_cast<size_t>(g->shard_numel()) * flat.element_size();
    if (whole) {
      for (auto& st : u.steps) st.add_(1);
      for (auto& c : u.counts) ++c;
      params.push_back(alias(flat, 0, {g->shard_numel()}));
      grads.push_back(alias(first_grad, -first_grad.storage_offset(), {g->shard_numel()}));
      exp_avgs.push_back(u.exp_avg);
      exp_avg_sqs.push_back(u.exp_avg_sq);
      steps.push_back(u.steps[0]);
      continue;
    }
    for (size_t i = 0; i < slots.size(); ++i) {
      const auto& s = slots[i];
      if (!g->shard_grad(s).defined()) continue;
      u.steps[i].add_(1);  // also for a rank's empty shard, so step counts stay equal
      ++u.counts[i];
      if (s.sharded.numel() == 0) continue;
      params.push_back(s.sharded);
      grads.push_back(g->shard_grad(s));
      exp_avgs.push_back(alias(u.exp_avg, s.offset, s.sharded.sizes()));
      exp_avg_sqs.push_back(alias(u.exp_avg_sq, s.offset, s.sharded.sizes()));
      steps.push_back(u.steps[i]);
    }
  }
  tensors_last_step_ = params.size();
  TORCH_CHECK(!params.empty() || units_.empty(),
              "fsdp::optim::FusedAdamW::step: no sharded parameter has a gradient. Call step() after "
              "loss.backward() (and zero_grad() after step()).");
  if (!params.empty()) {
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, o.lr(),
                      std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(),
                      /*amsgrad=*/false, /*maximize=*/false);
  }
  return loss;
}

std::vector<at::Tensor> FusedAdamW::state_tensors() const {
  std::vector<at::Tensor> out;
  for (const auto& u : units_) {
    if (!u.exp_avg.defined()) continue;
    out.push_back(u.exp_avg);
    out.push_back(u.exp_avg_sq);
    out.insert(out.end(), u.steps.begin(), u.steps.end());
  }
  return out;
}

}  // namespace fsdp::optim
