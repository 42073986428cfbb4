// What the wrapper costs at world size 1: one training step of the example GPT, plain LibTorch
// against the same model wrapped (full sharding over a one-rank group), at several sizes.
//
//   build/benchmarks/overhead_bench [--sizes small,1m,4m,350m,llama-small,llama1b] [--rounds 20]
//                                   [--batch-size 4] [--json] [--device cpu|cuda] [--mixed-precision bf16]
//                                   [--prefetch K] [--peak-tflops F] [--offload] [--activation-checkpointing [K]]
//                                   [--optimizer adamw|torch-adamw] [--profile DIR]
//
// The llama sizes are examples/llama/llama.h's Llama (SDPA, at::rms_norm): llama1b
// is about 1.0B parameters (width 2048, 16 layers, 16 heads over 8 key-value heads, MLP 8192,
// sequence 2048, vocabulary 256), the GPU check's.
//
// --optimizer adamw (default): the wrapped side steps with fsdp::optim::FusedAdamW (one fused pass
// per unit), plain LibTorch with the same ATen kernel over its parameter list
// (benchmarks/fsdp/plain_fused_adamw.h); torch-adamw: both with torch::optim::AdamW.
// --profile DIR: a trace of the first size's rounds 2-4 (plain and wrapped steps) and their table
// (programs/profile.h).
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
// Method: one process, both models built from the same seed, each with its own optimizer;
// after warm-up steps, the two step alternately (plain, wrapped, plain, ...) for --rounds rounds,
// so machine noise reaches both alike; each step is timed alone (forward, backward, optimizer step,
// zero_grad) and the medians are compared. Reported: the ratio wrapped / plain and the difference in
// ms per step. The step includes everything the library does at world size 1: its collectives
// over the one-rank group (copies), its hooks, its boundary checks and its allocations.
// Memory: each side's model state from shapes after its step (parameters and AdamW moments; the
// gradients were set to none by zero_grad), and the most bytes allocated during its step above
// those allocated when the step began (activations, gradients, the library's buffers), from the
// caching allocator on CUDA and the counting allocator on CPU: the largest over the measured rounds.
#include "benchmarks/fsdp/plain_fused_adamw.h"
#include "examples/gpt.h"
#include "examples/llama/llama.h"
#include "fsdp/fsdp.h"
#include "optim/fused_adamw.h"
#include "optim/state_bytes.h"
#include "programs/flags.h"
#include "programs/flops.h"
#include "programs/json_row.h"
#include "programs/profile.h"
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
#include <optional>
#include <string>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

using fsdp::programs::usage_error;

// Sizes of the example GPT (vocabulary 256, block 64): about 0.3M, 1.1M and 4.5M parameters.
const std::map<std::string, gpt::Config> kGptSizes = {
    {"small", gpt::Config{256, 64, 2, 4, 64, true}},
    {"1m", gpt::Config{256, 64, 4, 4, 128, true}},
    {"4m", gpt::Config{256, 64, 6, 4, 224, true}},
    // GPT-2 medium's shape (355M parameters with a 50,304-token vocabulary, block 1024): the GPU check's.
    {"350m", gpt::Config{50304, 1024, 24, 16, 1024, true}},
};

llama::Config llama_size(int64_t block, int64_t layers, int64_t heads, int64_t kv_heads, int64_t width, int64_t ffn) {
  llama::Config c;
  c.vocab_size = 256;
  c.block_size = block;
  c.n_layer = layers;
  c.n_head = heads;
  c.n_kv_head = kv_heads;
  c.n_embd = width;
  c.intermediate = ffn;
  return c;
}
const std::map<std::string, llama::Config> kLlamaSizes = {
    {"llama-small", llama_size(64, 2, 4, 2, 128, 512)},
    {"llama1b", llama_size(2048, 16, 16, 8, 2048, 8192)},
};

/// One size's two models: plain LibTorch and the same model (same seed) wrapped, each with its
/// forward (token ids -> logits), its parameters and its optimizer.
struct Pair {
  std::vector<torch::Tensor> plain_params;  // the plain model lives in plain_forward
  std::function<torch::Tensor(const torch::Tensor&)> plain_forward, wrapped_forward;
  std::optional<fsdp::FSDPModule> wrapped;
  fsdp::programs::TransformerShape flops;
  int64_t vocab = 0, block = 0;
};

/// Builds plain LibTorch's model (`make_plain()`) and the model `shard` wraps (`make_unit()`), each
/// from seed 0 and moved to `device`. `device_before_wrapped`: the device's bytes in between (the
/// plain side's parameters held).
template <typename MakePlain, typename MakeUnit, typename Shard>
Pair pair_of(MakePlain make_plain, MakeUnit make_unit, Shard shard, const torch::Device& device,
             int64_t* device_before_wrapped) {
  Pair p;
  torch::manual_seed(0);
  auto plain = make_plain();
  plain->to(device);
  if (device.is_cuda()) torch::cuda::synchronize();
  *device_before_wrapped = fsdp::memory::stats(device).current_bytes;
  torch::manual_seed(0);
  auto unwrapped = make_unit();
  unwrapped->to(device);
  auto w = shard(unwrapped);
  p.wrapped.emplace(w);
  p.wrapped_forward = [w](const torch::Tensor& t) mutable { return w(t); };
  p.plain_params = plain->parameters();
  p.plain_forward = [plain](const torch::Tensor& t) mutable { return plain->forward(t); };
  return p;
}

Pair make_pair_of(const std::string& size, int64_t checkpoint_every, const torch::Device& device,
                  const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const fsdp::FullyShardOptions& options,
                  int64_t* device_before_wrapped) {
  if (kGptSizes.count(size) != 0) {
    gpt::Config cfg = kGptSizes.at(size);
    cfg.checkpoint_every = checkpoint_every;
    Pair p = pair_of([&] { return gpt::make_gpt<false>(cfg); }, [&] { return gpt::make_gpt<true>(cfg); },
                     [&](const auto& m) { return fsdp::fully_shard(m, pg, options); }, device, device_before_wrapped);
    p.flops = gpt::flops_shape(cfg, p.wrapped->num_parameters());
    p.vocab = cfg.vocab_size;
    p.block = cfg.block_size;
    return p;
  }
  llama::Config cfg = kLlamaSizes.at(size);
  cfg.checkpoint_every = checkpoint_every;
  // A one-rank mesh: the tensor-parallel layers are plain ones (fsdp::tp at size 1).
  const fsdp::DeviceMesh mesh(pg, {{fsdp::kShardDim, 1}, {fsdp::kTensorDim, 1}});
  fsdp::tp::Group blocks(mesh), vocab(mesh);
  auto make = [&] { return llama::LlamaForCausalLM(cfg, blocks, vocab); };  // its layers are units
  Pair p = pair_of(
      make, make, [&](const auto& m) { return fsdp::fully_shard(m, mesh, options); }, device, device_before_wrapped);
  p.flops = llama::flops_shape(cfg, p.wrapped->num_parameters());
  p.vocab = cfg.vocab_size;
  p.block = cfg.block_size;
  return p;
}

const char* const kAbout =
    "  One training step of the example GPT, plain LibTorch against the same model wrapped (full sharding\n"
    "  over a one-rank group), alternating, at each size; the medians compared.\n"
    "  Exit status: 0 done, 2 bad flags, 1 other errors.\n";

int run(int argc, char** argv) {
  std::vector<std::string> sizes = {"small", "1m", "4m"};
  int rounds = 20;
  int64_t batch = 4;
  bool json = false;
  std::string device_name = "cpu", precision = "fp32";
  int prefetch = 1;
  double peak_tflops = 0;
  int64_t checkpoint_every = 0;  // --activation-checkpointing [K]: plain and wrapped alike
  bool offload = false;
  std::string optimizer = "adamw", profile;
  fsdp::programs::Flags flags("overhead_bench", kAbout);
  flags.names("--sizes", sizes, "sizes: small, 1m, 4m, 350m (GPTs), llama-small, llama1b")
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
                  "every K-th block recomputes its forward in backward (default every one)")
      .choice("--optimizer", optimizer, {"adamw", "torch-adamw"},
              "adamw: fused (FusedAdamW, and the same kernel for plain); torch-adamw: torch::optim::AdamW")
      .text("--profile", profile, "a trace of the first size's rounds 2-4 in DIR/trace.json, and their table", "DIR",
            /*non_empty=*/true);
  flags.parse(argc, argv);
  for (const auto& size : sizes) {
    if (kGptSizes.count(size) == 0 && kLlamaSizes.count(size) == 0) usage_error("unknown size '" + size + "'");
  }
  fsdp::programs::StepProfiler profiler(profile);
  if (profiler.on() && sizes.size() > 1) {
    std::cerr << "overhead_bench: --profile profiles the first size, " << sizes[0] << ", alone\n";
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
  auto options = fsdp::FullyShardOptions().prefetch(prefetch);
  if (bf16) options.mixed_precision(fsdp::MixedPrecisionPolicy().param_dtype(torch::kBFloat16));
  if (offload) options.offload_policy(fsdp::CPUOffloadPolicy());
  for (size_t n = 0; n < sizes.size(); ++n) {
    int64_t device_before_wrapped = 0;
    Pair pair = make_pair_of(sizes[n], checkpoint_every, device, pg, options, &device_before_wrapped);
    fsdp::FSDPModule& wrapped = *pair.wrapped;
    const auto& plain_params = pair.plain_params;
    const bool fused = optimizer == "adamw";
    const auto adamw = torch::optim::AdamWOptions(1e-4);
    std::unique_ptr<torch::optim::AdamW> plain_opt = fused
                                                         ? std::make_unique<bench::PlainFusedAdamW>(plain_params, adamw)
                                                         : std::make_unique<torch::optim::AdamW>(plain_params, adamw);
    // Offloaded, the step runs on the CPU: the vectorized, multi-threaded AdamW over each unit's
    // flat shard (it behaves as torch::optim::AdamW), whatever --optimizer says.
    std::unique_ptr<torch::optim::AdamW> wrapped_opt =
        fused || offload ? std::make_unique<fsdp::optim::FusedAdamW>(wrapped, adamw)
                         : std::make_unique<torch::optim::AdamW>(wrapped.parameters(), adamw);
    torch::manual_seed(1);
    auto tok = torch::randint(pair.vocab, {batch, pair.block + 1}, torch::kLong).to(device);
    auto x = tok.narrow(1, 0, pair.block), y = tok.narrow(1, 1, pair.block).flatten();
    using Clock = std::chrono::steady_clock;
    auto ms = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    std::vector<double> phases[2][3];  // [plain, wrapped][forward, backward, optimizer]
    int64_t step_peak[2] = {0, 0};     // [plain, wrapped]
    // The profile's steps: the plain and the wrapped step of measured rounds 2-4 (programs/profile.h).
    int64_t round = -1;  // the warm-up's
    // Plain LibTorch in bf16: autocast, fp32 weights and optimizer (the wrapped side's casts are
    // its policy's).
    auto step = [&](auto&& forward, torch::optim::Optimizer& opt, int which) {
      sync();
      const bool profiled = round >= 0 && fsdp::programs::profiled_step(round, rounds);
      profiler.begin(profiled, sizes[n] + (which == 0 ? " plain " : " wrapped ") + std::to_string(round), device);
      const int64_t base = fsdp::memory::stats(device).current_bytes;
      fsdp::memory::reset_peak(device);
      const auto t0 = Clock::now();
      torch::Tensor loss;
      {
        fsdp::programs::Phase phase("fsdp.forward");
        const bool autocast = bf16 && which == 0;
        at::autocast::set_autocast_enabled(device.type(), autocast);
        if (autocast) at::autocast::set_autocast_dtype(device.type(), torch::kBFloat16);
        loss = torch::nn::functional::cross_entropy(forward(x).flatten(0, 1), y);
        at::autocast::set_autocast_enabled(device.type(), false);
        at::autocast::clear_cache();
      }
      sync();
      const auto t1 = Clock::now();
      {
        fsdp::programs::Phase phase("fsdp.backward");
        loss.backward();
      }
      sync();
      const auto t2 = Clock::now();
      {
        fsdp::programs::Phase phase("fsdp.optimizer");
        opt.step();
        opt.zero_grad();
      }
      sync();
      const auto t3 = Clock::now();
      // It stops after the wrapped step of the last profiled round.
      profiler.end(profiled && which == 1 && !fsdp::programs::profiled_step(round + 1, rounds), 0,
                   json ? std::cerr : std::cout);
      phases[which][0].push_back(ms(t0, t1));
      phases[which][1].push_back(ms(t1, t2));
      phases[which][2].push_back(ms(t2, t3));
      step_peak[which] = std::max(step_peak[which], fsdp::memory::stats(device).peak_bytes - base);
      return ms(t0, t3);
    };
    auto plain_step = [&] { return step(pair.plain_forward, *plain_opt, 0); };
    auto wrapped_step = [&] { return step(pair.wrapped_forward, *wrapped_opt, 1); };
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
      round = r;
      p.push_back(plain_step());
      f.push_back(wrapped_step());
    }
    const double mp = median(p), mf = median(f);
    const auto plain_bytes = fsdp::optim::state_bytes(plain_params, plain_opt.get());
    const auto plain_state = static_cast<long long>(plain_bytes.total());
    sync();
    // The plain side's parameters were on the device before; its moments came with its first step.
    const auto wrapped_device_bytes = static_cast<long long>(fsdp::memory::stats(device).current_bytes -
                                                             device_before_wrapped - plain_bytes.optimizer);
    const auto wrapped_state =
        static_cast<long long>(fsdp::optim::state_bytes(wrapped.parameters(), wrapped_opt.get()).total());
    const long long params = static_cast<long long>(wrapped.num_parameters());
    // Model FLOPs (programs/flops.h) at each side's median step, against the peak given or the
    // device's by name.
    const double peak = fsdp::programs::resolve_peak_tflops(peak_tflops, device);
    const auto speed = [&](double ms) {
      return fsdp::programs::step_throughput(pair.flops, pair.block, batch * pair.block, ms, peak, 1);
    };
    const auto plain_speed = speed(mp), wrapped_speed = speed(mf);
    const double tflops_plain = plain_speed.flops_per_token * plain_speed.tokens_per_s / 1e12;
    const double tflops_wrapped = wrapped_speed.flops_per_token * wrapped_speed.tokens_per_s / 1e12;
    const double mfu_plain = plain_speed.mfu, mfu_wrapped = wrapped_speed.mfu;
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
          .add("optimizer", optimizer)
          .add("seq_len", pair.block)
          .add("batch_size", batch)
          .add("flops_per_token", plain_speed.flops_per_token, "%.17g")
          .add("peak_tflops", peak > 0 ? peak : std::nan(""), "%.6g")  // null: none known
          .add("plain_tokens_per_s", plain_speed.tokens_per_s, "%.6g")
          .add("wrapped_tokens_per_s", wrapped_speed.tokens_per_s, "%.6g")
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
