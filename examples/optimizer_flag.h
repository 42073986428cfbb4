// --optimizer, the examples' and benchmarks' one way to choose the optimizer of a wrapped model:
//   adamw        fsdp::optim::FusedAdamW (the default): ATen's fused kernel, one call over every
//                unit (each unit's flat shard one tensor at 2+ ranks; at one rank, where the
//                gradients stay autograd's, one tensor per parameter)
//   torch-adamw  torch::optim::AdamW: the same update (to 1e-6), one parameter at a time
//   sgd          torch::optim::SGD with momentum 0.9 (train_gpt only)
// Both AdamWs keep AdamW's state (one AdamWParamState per parameter), so a checkpoint saved with one
// resumes with the other.
#pragma once

#include "fsdp/fully_shard.h"
#include "optim/fused_adamw.h"
#include "programs/flags.h"

#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <string>
#include <vector>

namespace examples {

/// --optimizer, and the retired --fused refused with what replaced it.
inline void add_optimizer_flag(fsdp::programs::Flags& flags, std::string& name, bool with_sgd) {
  std::vector<std::string> choices{"adamw", "torch-adamw"};
  if (with_sgd) choices.emplace_back("sgd");
  flags
      .choice("--optimizer", name, choices,
              std::string("adamw: fsdp::optim::FusedAdamW (fused kernel); torch-adamw: torch::optim::AdamW") +
                  (with_sgd ? "; sgd: SGD, momentum 0.9" : ""))
      .custom("--fused", "", "",
              [](const std::string&) {
                fsdp::programs::usage_error(
                    "--fused is gone: fsdp::optim::FusedAdamW is the default now (--optimizer adamw); --optimizer "
                    "torch-adamw selects torch::optim::AdamW");
              })
      .hidden();
}

/// What the log line calls it.
inline std::string optimizer_label(const std::string& name) {
  if (name == "adamw") return "fused AdamW";
  if (name == "torch-adamw") return "torch AdamW";
  return "SGD (momentum 0.9)";
}

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& name, const fsdp::FSDPModule& model,
                                                               double lr, double weight_decay) {
  const auto adamw = torch::optim::AdamWOptions(lr).weight_decay(weight_decay);
  if (name == "adamw") return std::make_unique<fsdp::optim::FusedAdamW>(model, adamw);
  if (name == "torch-adamw") return std::make_unique<torch::optim::AdamW>(model.parameters(), adamw);
  return std::make_unique<torch::optim::SGD>(model.parameters(),
                                             torch::optim::SGDOptions(lr).momentum(0.9).weight_decay(weight_decay));
}

}  // namespace examples
