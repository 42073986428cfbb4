// What the wrapper costs at world size 1: one training step of the example GPT, plain LibTorch
// against the same model wrapped (full sharding over a one-rank group), at several sizes.
//
//   build/benchmarks/overhead_bench [--sizes small,1m,4m,350m] [--rounds 20] [--batch-size 4] [--json]
//                                   [--device cpu|cuda] [--mixed-precision bf16] [--prefetch K]
//                                   [--peak-tflops F] [--offload] [--activation-checkpointing [K]]
//
// --mixed-precision bf16: the wrapped model gathers and computes in bf16 with fp32 master weights
// (fsdp::MixedPrecisionPolicy); plain LibTorch runs the same fp32 model under autocast to bf16
// (the usual way to train in bf16 without a wrapper). Both report model FLOPs per second (6Ψ per
// token for the weights plus 12·L·T·C for attention, as llm.c and nanoGPT count them) and, with
// --peak-tflops (the device's dense peak in that precision), the model FLOPs utilization.
//
// --offload (CUDA): the wrapped model keeps its shards, gradients and optimizer state in pinned host
// memory (fsdp::CPUOffloadPolicy) and steps with fsdp::optim::FusedAdamW on the CPU; plain LibTorch
// stays wholly on the device. Reported beside the times: the device bytes the wrapped model holds
// between steps (the allocator's bytes after the rounds, less those held before it was built and
// the plain side's AdamW moments from shapes), which without offload is its model state.
//
// Method: one process, both models built from the same seed, each with its own torch::optim::AdamW;
// after warm-up steps, the two step alternately (plain, wrapped, plain, ...) for --rounds rounds,
// so machine noise reaches both alike; each step is timed alone (forward, backward, optimizer step,
// zero_grad) and the medians are compared. Reported: the ratio wrapped / plain and the difference in
// ms per step. The step includes everything the library does at world size 1: its collectives
// over the one-rank group (copies), its hooks, its boundary checks and its allocations.
// Memory: each side's model state from shapes after its step (parameters and AdamW moments; the
// gradients were set to none by zero_grad), and the most bytes allocated during its step above
// those allocated when the step began (activations, gradients, the library's buffers), from the
// caching allocator on CUDA and the counting allocator on CPU: the largest over the measured rounds.
#include "examples/gpt.h"
#include "fsdp/fsdp.h"
#include "optim/fused_adamw.h"
#include "optim/state_bytes.h"
#include "programs/flags.h"
#include "programs/flops.h"
#include "programs/json_row.h"
#include "programs/program.h"

#include <ATen/autocast_mode.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

using fsdp::programs::usage_error;

const char* const kAbout =
    "  One training step of the example GPT, plain LibTorch against the same model wrapped (full sharding\n"
    "  over a one-rank group), alternating, at each size; the medians compared.\n"
    "  Exit status: 0 done, 2 bad flags, 1 other errors.\n";

int run(int argc, char** argv) {
  // Sizes of the example GPT (vocabulary 256, block 64): about 0.3M, 1.1M and 4.5M parameters.
  const std::map<std::string, gpt::Config> kSizes = {
      {"small", gpt::Config{256, 64, 2, 4, 64, true}},
      {"1m", gpt::Config{256, 64, 4, 4, 128, true}},
      {"4m", gpt::Config{256, 64, 6, 4, 224, true}},
      // GPT-2 medium's shape (355M parameters with a 50,304-token vocabulary, block 1024): the GPU check's.
      {"350m", gpt::Config{50304, 1024, 24, 16, 1024, true}},
  };
  std::vector<std::string> sizes = {"small", "1m", "4m"};
  int rounds = 20;
  int64_t batch = 4;
  bool json = false;
  std::string device_name = "cpu", precision = "fp32";
  int prefetch = 1;
  double peak_tflops = 0;
  int64_t checkpoint_every = 0;  // --activation-checkpointing [K]: plain and wrapped alike
  bool offload = false;
  fsdp::programs::Flags flags("overhead_bench", kAbout);
  flags.names("--sizes", sizes, "GPT sizes: small, 1m, 4m, 350m")
      .integer("--rounds", rounds, 3, 100000, "alternating rounds of plain and wrapped steps")
      .integer("--batch-size", batch, 1, 4096, "rows per step", "B")
      .toggle("--json", json, "the rows as a JSON array on stdout")
      .choice("--device", device_name, {"cpu", "cuda"}, "where both models train")
      .choice("--mixed-precision", precision, {"bf16"}, "the wrapped model in bf16, plain LibTorch under autocast")
      .integer("--prefetch", prefetch, 0, 64, "units all-gathered ahead", "K")
      .number("--peak-tflops", peak_tflops, 0, false, 1e9, "the device's dense peak, for the MFU (default: by name)",
              "F")
      .toggle("--offload", offload, "(cuda) the wrapped model's state in pinned host memory")
      .integer_or("--activation-checkpointing", checkpoint_every, int64_t{1}, 1, 1 << 20,
                  "every K-th block recomputes its forward in backward (default every one)");
  flags.parse(argc, argv);
  for (const auto& size : sizes) {
    if (kSizes.count(size) == 0) usage_error("unknown size '" + size + "'");
  }
  if (device_name == "cuda" && !torch::cuda::is_available()) {
    throw fsdp::programs::UsageError(
        "--device cuda, but this machine has no CUDA device (or LibTorch was built without CUDA)", false);
  }
  if (offload && device_name != "cuda") {
    usage_error("--offload needs --device cuda (a CPU model has nothing to offload)");
  }
  const torch::Device device(device_name);
  if (device.is_cpu()) fsdp::memory::enable_cpu_counting();  // before any model exists
  const bool bf16 = precision == "bf16";
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize();
  };
  auto pg = fsdp::init_process_group();
  if (json) std::printf("[\n");
  for (size_t n = 0; n < sizes.size(); ++n) {
    gpt::Config cfg = kSizes.at(sizes[n]);
    cfg.checkpoint_every = checkpoint_every;
    torch::manual_seed(0);
    auto plain = gpt::make_gpt<false>(cfg);
    plain->to(device);
    sync();
    const int64_t device_before_wrapped = fsdp::memory::stats(device).current_bytes;
    torch::manual_seed(0);
    auto unwrapped = gpt::make_gpt<true>(cfg);
    unwrapped->to(device);
    auto options = fsdp::FullyShardOptions().prefetch(prefetch);
    if (bf16) options.mixed_precision(fsdp::MixedPrecisionPolicy().param_dtype(torch::kBFloat16));
    if (offload) options.offload_policy(fsdp::CPUOffloadPolicy());
    auto wrapped = fsdp::fully_shard(unwrapped, pg, options);
    torch::optim::AdamW plain_opt(plain->parameters(), torch::optim::AdamWOptions(1e-4));
    // Offloaded, the step runs on the CPU: the vectorized, multi-threaded AdamW over each unit's
    // flat shard (it behaves as torch::optim::AdamW).
    std::unique_ptr<torch::optim::AdamW> wrapped_opt_ptr =
        offload ? std::make_unique<fsdp::optim::FusedAdamW>(wrapped, torch::optim::AdamWOptions(1e-4))
                : std::make_unique<torch::optim::AdamW>(wrapped->parameters(), torch::optim::AdamWOptions(1e-4));
    torch::optim::AdamW& wrapped_opt = *wrapped_opt_ptr;
    torch::manual_seed(1);
    auto tok = torch::randint(cfg.vocab_size, {batch, cfg.block_size + 1}, torch::kLong).to(device);
    auto x = tok.narrow(1, 0, cfg.block_size), y = tok.narrow(1, 1, cfg.block_size).flatten();
    using Clock = std::chrono::steady_clock;
    auto ms = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    std::vector<double> phases[2][3];  // [plain, wrapped][forward, backward, optimizer]
    int64_t step_peak[2] = {0, 0};     // [plain, wrapped]
    // Plain LibTorch in bf16: autocast, fp32 weights and optimizer (the wrapped side's casts are
    // its policy's).
    auto step = [&](auto&& forward, torch::optim::Optimizer& opt, int which) {
      sync();
      const int64_t base = fsdp::memory::stats(device).current_bytes;
      fsdp::memory::reset_peak(device);
      const auto t0 = Clock::now();
      torch::Tensor loss;
      {
        const bool autocast = bf16 && which == 0;
        at::autocast::set_autocast_enabled(device.type(), autocast);
        if (autocast) at::autocast::set_autocast_dtype(device.type(), torch::kBFloat16);
        loss = torch::nn::functional::cross_entropy(forward(x).flatten(0, 1), y);
        at::autocast::set_autocast_enabled(device.type(), false);
        at::autocast::clear_cache();
      }
      sync();
      const auto t1 = Clock::now();
      loss.backward();
      sync();
      const auto t2 = Clock::now();
      opt.step();
      opt.zero_grad();
      sync();
      const auto t3 = Clock::now();
      phases[which][0].push_back(ms(t0, t1));
      phases[which][1].push_back(ms(t1, t2));
      phases[which][2].push_back(ms(t2, t3));
      step_peak[which] = std::max(step_peak[which], fsdp::memory::stats(device).peak_bytes - base);
      return ms(t0, t3);
    };
    auto plain_step = [&] { return step([&](const torch::Tensor& t) { return plain->forward(t); }, plain_opt, 0); };
    auto wrapped_step = [&] { return step([&](const torch::Tensor& t) { return wrapped(t); }, wrapped_opt, 1); };
    for (int w = 0; w < 3; ++w) {
      plain_step();
      wrapped_step();
    }
    for (auto& side : phases) {
      for (auto& v : side) v.clear();  // warm-up steps are not measured
    }
    step_peak[0] = step_peak[1] = 0;
    std::vector<double> p, f;
    for (int r = 0; r < rounds; ++r) {
      p.push_back(plain_step());
      f.push_back(wrapped_step());
    }
    const double mp = median(p), mf = median(f);
    const auto plain_bytes = fsdp::optim::state_bytes(plain->parameters(), &plain_opt);
    const auto plain_state = static_cast<long long>(plain_bytes.total());
    sync();
    // The plain side's parameters were on the device before; its moments came with its first step.
    const auto wrapped_device_bytes = static_cast<long long>(fsdp::memory::stats(device).current_bytes -
                                                             device_before_wrapped - plain_bytes.optimizer);
    const auto wrapped_state =
        static_cast<long long>(fsdp::optim::state_bytes(wrapped.parameters(), &wrapped_opt).total());
    const long long params = static_cast<long long>(wrapped.num_parameters());
    // Model FLOPs per step (programs/flops.h): 6 per multiplying parameter per token (the
    // embeddings are lookups; the untied head counts) plus attention's 12·L·H·(C/H)·T per token.
    const double tokens = static_cast<double>(batch * cfg.block_size);
    const fsdp::programs::TransformerShape shape{params, (cfg.vocab_size + cfg.block_size) * cfg.n_embd, cfg.n_layer,
                                                 cfg.n_head, cfg.n_embd / cfg.n_head};
    const double flops = tokens * fsdp::programs::flops_per_token(shape, cfg.block_size);
    const double tflops_plain = flops / (mp * 1e-3) / 1e12, tflops_wrapped = flops / (mf * 1e-3) / 1e12;
    const double peak = fsdp::programs::resolve_peak_tflops(peak_tflops, device);  // given, else by name
    const double mfu_plain = fsdp::programs::mfu(flops / tokens, tokens / (mp * 1e-3), peak, 1);
    const double mfu_wrapped = fsdp::programs::mfu(flops / tokens, tokens / (mf * 1e-3), peak, 1);
    // Where the difference is: the medians of forward, backward and optimizer step + zero_grad.
    double ph[2][3];
    for (int w = 0; w < 2; ++w) {
      for (int k = 0; k < 3; ++k) ph[w][k] = median(phases[w][k]);
    }
    if (json) {
      const auto phases_ms = [&](int w) {
        return fsdp::programs::rounded(std::vector<double>{ph[w][0], ph[w][1], ph[w][2]}, "%.4f");
      };
      fsdp::programs::JsonRow row;
      row.add("size", sizes[n])
          .add("params", params)
          .add("rounds", rounds)
          .add("device", device_name)
          .add("precision", precision)
          .add("prefetch", prefetch)
          .add("plain_ms", mp, "%.4f")
          .add("wrapped_ms", mf, "%.4f")
          .add("ratio", mf / mp, "%.4f")
          .add("diff_ms", mf - mp, "%.4f")
          .add("plain_phases_ms", phases_ms(0))
          .add("wrapped_phases_ms", phases_ms(1))
          .add("plain_tflops", tflops_plain, "%.6g")
          .add("wrapped_tflops", tflops_wrapped, "%.6g")
          .add("plain_mfu", mfu_plain, "%.4f")
          .add("wrapped_mfu", mfu_wrapped, "%.4f")
          .add("mfu_ratio", tflops_wrapped / tflops_plain, "%.4f")
          .add("plain_state_bytes", plain_state)
          .add("wrapped_state_bytes", wrapped_state)
          .add("plain_step_peak_bytes", step_peak[0])
          .add("wrapped_step_peak_bytes", step_peak[1])
          .add("offload", offload)
          .add("wrapped_device_bytes_between_steps", wrapped_device_bytes)
          .add("activation_checkpointing", checkpoint_every);
      std::printf("  %s%s\n", row.text().c_str(), n + 1 < sizes.size() ? "," : "");
    } else {
      std::printf(
          "%-6s %9lld params: plain %8.3f ms/step, wrapped %8.3f ms/step, ratio %.3f, %+.3f ms (forward/backward/"
          "optimizer: plain %.2f/%.2f/%.2f, wrapped %.2f/%.2f/%.2f)\n",
          sizes[n].c_str(), params, mp, mf, mf / mp, mf - mp, ph[0][0], ph[0][1], ph[0][2], ph[1][0], ph[1][1],
          ph[1][2]);
      std::printf(
          "%-6s model state plain %lld, wrapped %lld bytes; step peak above its start plain %lld, wrapped %lld "
          "bytes (ratio %.3f)\n",
          sizes[n].c_str(), plain_state, wrapped_state, static_cast<long long>(step_peak[0]),
          static_cast<long long>(step_peak[1]),
          static_cast<double>(step_peak[1]) / static_cast<double>(std::max<int64_t>(step_peak[0], 1)));
      std::printf("%-6s wrapped%s: device bytes held between steps %lld\n", sizes[n].c_str(),
                  offload ? " (offloaded)" : "", wrapped_device_bytes);
    }
  }
  if (json) std::printf("]\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::programs::Program("overhead_bench").main([&] { return run(argc, argv); });
}
