// train_gpt's semi-synchronous training: --local-sgd H or --diloco H [--outer-lr --outer-momentum]
// [--fragments F] [--overlap] over --strategy hybrid. Each hybrid group of --shard-group-size ranks is a replica
// that trains alone; every H steps fsdp::optim::LocalSGD averages the replicas' parameters, or
// fsdp::optim::DiLoCo applies its outer optimizer to their mean pseudo-gradient (docs/local-sgd.md).
#pragma once

#include "optim/diloco.h"
#include "optim/local_sgd.h"
#include "programs/flags.h"

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace examples {

struct OuterFlags {
  int64_t local_sgd = 0;  // H of LocalSGD (0: off)
  int64_t diloco = 0;     // H of DiLoCo (0: off)
  double outer_lr = 0.7, outer_momentum = 0.9;
  int64_t fragments = 1;
  bool overlap = false;    // the outer exchange in flight during the next step
  bool outer_set = false;  // --outer-lr or --outer-momentum given

  bool on() const { return local_sgd > 0 || diloco > 0; }

  /// These flags in a program's table.
  void add_to(fsdp::programs::Flags& f) {
    f.integer("--local-sgd", local_sgd, 1, 1 << 20, "LocalSGD: average the replicas every H steps", "H")
        .integer("--diloco", diloco, 1, 1 << 20, "DiLoCo: an outer step over the replicas every H steps", "H")
        .custom("--outer-lr", "LR", "DiLoCo's outer learning rate (default 0.7)",
                [this](const std::string& v) {
                  outer_lr = fsdp::programs::parse_double("--outer-lr", v, 0, false, 1e6);
                  outer_set = true;
                })
        .custom("--outer-momentum", "M", "DiLoCo's outer Nesterov momentum, below 1 (default 0.9)",
                [this](const std::string& v) {
                  outer_momentum = fsdp::programs::parse_double("--outer-momentum", v, 0, true, 1);
                  outer_set = true;
                  if (outer_momentum >= 1) fsdp::programs::usage_error("--outer-momentum must be below 1");
                })
        .integer("--fragments", fragments, 1, 1 << 20, "groups of units synchronized in turn", "F")
        .toggle("--overlap", overlap, "the outer exchange in flight during the next step");
  }

  /// A flag without the ones it needs is an input error that says what to add. `hybrid`: whether
  /// --strategy is hybrid.
  void check(bool hybrid) const {
    auto refuse = [](const std::string& what) { fsdp::programs::usage_error(what); };
    if (local_sgd > 0 && diloco > 0) refuse("--local-sgd and --diloco are two outer steps: pass one");
    if (outer_set && diloco == 0)
      refuse("--outer-lr and --outer-momentum set DiLoCo's outer optimizer: add --diloco H");
    if (fragments > 1 && !on()) refuse("--fragments needs --local-sgd H or --diloco H");
    if (overlap && !on()) refuse("--overlap needs --local-sgd H or --diloco H");
    const int64_t H = local_sgd + diloco;
    if (on() && H % fragments != 0) {
      refuse("--fragments " + std::to_string(fragments) + " does not divide H = " + std::to_string(H) +
             " (a fragment is synchronized every H / F steps, in turn)");
    }
    if (on() && !hybrid) {
      refuse(std::string(local_sgd > 0 ? "--local-sgd" : "--diloco") +
             " trains hybrid sharding's replicas apart: add --strategy hybrid --shard-group-size S (each group of S "
             "ranks is a replica)");
    }
  }
};

/// The optimizer's step through LocalSGD or DiLoCo when they are on, else the step itself.
class OuterStep {
 public:
  OuterStep(const OuterFlags& f, const fsdp::FSDPModule& model, torch::optim::Optimizer& inner) {
    if (f.local_sgd > 0) {
      local_ = std::make_unique<fsdp::optim::LocalSGD>(
          model, inner, fsdp::optim::LocalSGDOptions(f.local_sgd).fragments(f.fragments).overlap(f.overlap));
    } else if (f.diloco > 0) {
      diloco_ = std::make_unique<fsdp::optim::DiLoCo>(model, inner,
                                                      fsdp::optim::DiLoCoOptions(f.diloco)
                                                          .outer_lr(f.outer_lr)
                                                          .outer_momentum(f.outer_momentum)
                                                          .fragments(f.fragments)
                                                          .overlap(f.overlap));
    }
  }
  /// Runs `inner_step` (the optimizer's step), then the outer step when one is due.
  void step(const std::function<void()>& inner_step) {
    if (local_) {
      local_->step(inner_step);
    } else if (diloco_) {
      diloco_->step(inner_step);
    } else {
      inner_step();
    }
  }
  /// Applies an outer exchange still in flight (--overlap), at the end of training.
  void flush() {
    if (local_) local_->flush();
    if (diloco_) diloco_->flush();
  }
  /// DiLoCo, when on (its outer state is model state too).
  fsdp::optim::DiLoCo* diloco() const { return diloco_.get(); }

 private:
  std::unique_ptr<fsdp::optim::LocalSGD> local_;
  std::unique_ptr<fsdp::optim::DiLoCo> diloco_;
};

}  // namespace examples
