// overhead_bench's plain side at its best: AdamW over ATen's fused kernel, one multi-tensor call over
// every parameter with a gradient (what a LibTorch program without this library would write for
// speed; torch::optim::AdamW loops over the parameters), so that the wrapped side's
// fsdp::optim::FusedAdamW is compared with the same kernel. Its state is torch::optim::AdamW's.
#pragma once

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/zeros.h>
#include <torch/optim/adamw.h>

#include <map>
#include <vector>

namespace bench {

class PlainFusedAdamW : public torch::optim::AdamW {
 public:
  using AdamW::AdamW;

  at::Tensor step(LossClosure closure = nullptr) override {
    TORCH_CHECK(!closure, "PlainFusedAdamW: no closure");
    at::NoGradGuard no_grad;
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(param_groups()[0].options());
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
    for (auto& p : param_groups()[0].params()) {
      if (!p.grad().defined()) continue;
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto st = std::make_unique<torch::optim::AdamWParamState>();
        st->step(0);
        st->exp_avg(at::zeros_like(p));
        st->exp_avg_sq(at::zeros_like(p));
        slot = std::move(st);
        steps_[p.unsafeGetTensorImpl()] = at::zeros({}, p.options().dtype(at::kFloat));
      }
      auto& st = static_cast<torch::optim::AdamWParamState&>(*slot);
      st.step(st.step() + 1);
      params.push_back(p);
      grads.push_back(p.grad());
      exp_avgs.push_back(st.exp_avg());
      exp_avg_sqs.push_back(st.exp_avg_sq());
      steps.push_back(steps_.at(p.unsafeGetTensorImpl()));
    }
    if (params.empty()) return {};
    at::_foreach_add_(steps, 1);  // the kernel reads the step count from the device
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, o.lr(),
                      std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(), /*amsgrad=*/false,
                      /*maximize=*/false);
    return {};
  }

 private:
  std::map<c10::TensorImpl*, at::Tensor> steps_;  // each parameter's step count, on its device
};

}  // namespace bench
