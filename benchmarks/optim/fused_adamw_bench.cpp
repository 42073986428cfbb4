// FusedAdamW against torch::optim::AdamW on the same shards, side by side in one run, at each
// thread count; and the update's bytes per second against a memory copy's.
//
//   build/benchmarks/fused_adamw_bench [--n-layer 8] [--n-embd 256] [--steps 30] [--rounds 5] [--threads 1,2]
//
// One process (the update is local to each rank, so one rank's shards are what matters). Both
// optimizers step the same sharded model with the same gradients, alternating in rounds so that
// machine noise hits both; the result is the ratio of their mean step times. FusedAdamW is the
// optimizer of a CPU step (CPU offload): one vectorized, multi-threaded pass over each unit's flat
// shard (PyTorch's _fused_adamw_ CPU kernel). The update is memory-bound: per element it reads the
// parameter, gradient and both moments and writes the parameter and moments, 28 bytes in fp32;
// a copy of the same number of bytes (tensor copy_, same threads: reads and writes counted) is
// what the memory gives.
#include "examples/gpt.h"
#include "fsdp/fsdp.h"
#include "programs/flags.h"
#include "programs/program.h"

#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {

const char* const kAbout =
    "  FusedAdamW against torch::optim::AdamW on the same shards, alternating in rounds, at each\n"
    "  intra-op thread count; and the update's bytes per second against a copy's. One process.\n"
    "  Exit status: 0 done, 2 bad flags, 1 other errors.\n";

int run(int argc, char** argv) {
  gpt::Config cfg;
  cfg.n_layer = 8;
  cfg.n_embd = 256;
  int steps = 30, rounds = 5;
  std::vector<int> threads = {1};
  fsdp::programs::Flags flags("fused_adamw_bench", kAbout);
  flags.integer("--n-layer", cfg.n_layer, 1, 100000, "blocks", "L")
      .integer("--n-embd", cfg.n_embd, 1, 1 << 20, "the embedding width, a multiple of 4 (the heads)", "C")
      .integer("--steps", steps, 1, 1000000, "optimizer steps per round")
      .integer("--rounds", rounds, 1, 1000000, "alternating rounds")
      .integers("--threads", threads, 1, 1024, "intra-op thread counts");
  flags.parse(argc, argv);
  if (cfg.n_embd % cfg.n_head != 0) fsdp::programs::usage_error("--n-embd must be a multiple of 4 (the heads)");
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
  int64_t elements = 0;
  for (const auto& p : model.parameters()) elements += p.numel();
  const double update_bytes = 28.0 * static_cast<double>(elements);
  // The copy: as many bytes as the update moves (half read, half written).
  at::Tensor src = torch::rand({static_cast<int64_t>(update_bytes / 8)}), dst = torch::empty_like(src);
  auto time_copy = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    for (int s = 0; s < steps; ++s) dst.copy_(src);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
  };
  for (int T : threads) {
    at::set_num_threads(T);
    double f = 0, p = 0, c = 0;
    for (int r = 0; r < rounds; ++r) {
      const double fr = time_steps(fused), pr = time_steps(plain), cr = time_copy();
      f += fr;
      p += pr;
      c += cr;
      std::printf(
          "threads %d round %d: fused %.3f ms/step, torch::optim::AdamW %.3f ms/step, ratio %.3f, copy %.3f ms\n", T, r,
          fr, pr, fr / pr, cr);
    }
    f /= rounds, p /= rounds, c /= rounds;
    std::printf("params %lld (this rank's shards), units %zu, intra-op threads %d\n", static_cast<long long>(elements),
                model.units().size(), at::get_num_threads());
    std::printf(
        "threads %d mean: fused %.3f ms/step, torch::optim::AdamW %.3f ms/step, fused/unfused time ratio %.3f "
        "(speed-up %.2fx); fused %.2f GB/s, torch AdamW %.2f GB/s, copy %.2f GB/s, fused/copy %.3f\n",
        T, f, p, f / p, p / f, update_bytes / f / 1e6, update_bytes / p / 1e6, update_bytes / c / 1e6, c / f);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::programs::Program("fused_adamw_bench").main([&] { return run(argc, argv); });
}
