// FusedAdamW against torch::optim::AdamW on the same shards, side by side in one run.
//
//   build/benchmarks/fused_adamw_bench [--n-layer 8] [--n-embd 256] [--steps 30] [--rounds 5]
//
// One process (the update is local to each rank, so one rank's shards are what matters). Both
// optimizers step the same sharded model with the same gradients, alternating in rounds so that
// machine noise hits both; the result is the ratio of their mean step times.
#include "examples/gpt.h"
#include "fsdp/fsdp.h"

#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  gpt::Config cfg;
  cfg.n_layer = 8;
  cfg.n_embd = 256;
  int steps = 30, rounds = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    long v = std::atol(argv[i + 1]);
    if (k == "--n-layer")
      cfg.n_layer = v;
    else if (k == "--n-embd")
      cfg.n_embd = v;
    else if (k == "--steps")
      steps = static_cast<int>(v);
    else if (k == "--rounds")
      rounds = static_cast<int>(v);
  }
  auto pg = fsdp::init_process_group();
  torch::manual_seed(0);
  auto model = fsdp::fully_shard(gpt::make_gpt<true>(cfg), pg);
  for (const auto& p : model.parameters()) p.mutable_grad() = torch::randn_like(p) * 1e-3;
  const auto opts = torch::optim::AdamWOptions(1e-4).weight_decay(0.1);
  fsdp::optim::FusedAdamW fused(model, opts);
  torch::optim::AdamW plain(model.parameters(), opts);
  auto time_steps = [&](torch::optim::Optimizer& o) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int s = 0; s < steps; ++s) o.step();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
  };
  time_steps(fused);  // warm-up: state allocation
  time_steps(plain);
  double f = 0, p = 0;
  for (int r = 0; r < rounds; ++r) {
    const double fr = time_steps(fused), pr = time_steps(plain);
    f += fr;
    p += pr;
    std::printf("round %d: fused %.3f ms/step, torch::optim::AdamW %.3f ms/step, ratio %.3f\n", r, fr, pr, fr / pr);
  }
  std::printf("params %lld, units %zu, intra-op threads %d\n", static_cast<long long>(model.num_parameters()),
              model.units().size(), at::get_num_threads());
  std::printf("mean: fused %.3f ms/step, torch::optim::AdamW %.3f ms/step, fused/unfused time ratio %.3f\n", f / rounds,
              p / rounds, f / p);
  return 0;
}
