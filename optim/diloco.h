// DiLoCo (Douillard et al., 2023) over hybrid sharding's replicas: each replica (a shard group)
// trains alone with its inner optimizer; every H inner steps the outer step takes the
// pseudo-gradient (global - local), averages it over the replicas, and applies an outer optimizer
// (Nesterov SGD by default) to fp32 global shards, which then replace every replica's parameters.
// Each rank works on its own shard only: one all-reduce over the ranks holding the same shard.
//
//   fsdp::optim::DiLoCo diloco(model, inner, fsdp::optim::DiLoCoOptions(/*sync_every=*/10));
//   for (...) { model(x, y).backward(); diloco.step(); inner.zero_grad(); }
//
// With outer_lr 1 and outer_momentum 0 it is LocalSGD (the global shards become the replicas'
// mean). See docs/local-sgd.md.
#pragma once

#include "fsdp/export.h"
#include "fsdp/fully_shard.h"

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::optim {
namespace detail {
class FSDP_HIDDEN ReplicaSync;
}

struct DiLoCoOptions {
  /// Makes the outer optimizer over the global shards (fp32, one per parameter, this rank's rows).
  using OuterOptimizer = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> global)>;

  /* implicit */ DiLoCoOptions(int64_t sync_every) : sync_every_(sync_every) {}
  /// H: the inner steps between two outer steps of a fragment.
  TORCH_ARG(int64_t, sync_every);
  /// The default outer optimizer, torch::optim::SGD: its learning rate, and its momentum, Nesterov
  /// when above 0 (the paper's 0.7 and 0.9). Momentum 0 is plain SGD (LibTorch's SGD refuses
  /// Nesterov without momentum).
  TORCH_ARG(double, outer_lr) = 0.7;
  TORCH_ARG(double, outer_momentum) = 0.9;
  /// Any torch::optim optimizer instead (outer_lr and outer_momentum are then not used):
  ///   .outer_optimizer([](std::vector<at::Tensor> g) {
  ///     return std::make_unique<torch::optim::Adam>(g, torch::optim::AdamOptions(1e-3)); })
  TORCH_ARG(OuterOptimizer, outer_optimizer) = nullptr;
  /// Streaming DiLoCo: F fragments (runs of consecutive units) synchronized in turn, one every
  /// H / F inner steps; F must divide H. See LocalSGDOptions::fragments.
  TORCH_ARG(int64_t, fragments) = 1;
  /// The overlapped variant: the mean pseudo-gradient's all-reduce is begun at its step and left in
  /// flight while the next inner step computes; after it the outer step runs and the parameters
  /// become p += new_global - p_then (the new global shards plus this replica's last inner step):
  /// one step stale. flush() applies one still in flight (at the end of training).
  TORCH_ARG(bool, overlap) = false;
};

class DiLoCo {
 public:
  /// Sets the model's replicas to train apart (refused unless it is hybrid-sharded), gives every
  /// replica the first replica's shards, and keeps them as the global shards (fp32). `inner` must
  /// outlive this object. Every data-parallel rank must construct it with the same options.
  DiLoCo(const FSDPModule& model, torch::optim::Optimizer& inner, const DiLoCoOptions& options);
  ~DiLoCo();
  DiLoCo(const DiLoCo&) = delete;  // checkpoints refer to it (its global shards, its flush)
  DiLoCo& operator=(const DiLoCo&) = delete;

  /// The inner step (inner.step()), then the outer step of each fragment whose turn it is. Call it
  /// where the optimizer's step() would be, on every rank, once per step.
  void step();
  /// The same with `inner_step` instead of inner.step() (e.g. [&] { scaler.step(inner); }).
  void step(const std::function<void()>& inner_step);

  /// Overlapped: applies the outer step in flight now, if any (waits for it); else nothing.
  void flush();

  /// The global shards: fp32 copies of this rank's parameter shards as of the last outer step (the
  /// outer optimizer's parameters), one per parameter, in shard_specs() order.
  const std::vector<at::Tensor>& global_shards() const { return global_; }
  torch::optim::Optimizer& outer_optimizer() { return *outer_; }
  int64_t inner_steps() const;
  int replicas() const;
  int replica() const;
  const DiLoCoOptions& options() const { return options_; }

 private:
  /// The pseudo-gradient of fragment f (global - local, per unit, fp32).
  std::vector<at::Tensor> pseudo_gradient(size_t f);
  /// Steps fragment f's global shards with `mean` (the replicas' mean pseudo-gradient, per unit).
  void outer_step(size_t f, const std::vector<at::Tensor>& mean);

  torch::optim::Optimizer& inner_;
  DiLoCoOptions options_;
  std::unique_ptr<detail::ReplicaSync> sync_;
  std::vector<std::vector<at::Tensor>> global_flats_;  // per fragment, per unit: flat fp32, padded
  std::vector<at::Tensor> global_;  // every parameter's (shard_specs() order): views of global_flats_
  std::unique_ptr<torch::optim::Optimizer> outer_;
};

}  // namespace fsdp::optim

FSDP_PUBLIC_END
