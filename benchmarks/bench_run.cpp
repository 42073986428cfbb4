#include "benchmarks/bench_run.h"

#include <cmath>

#include "examples/device_flag.h"
#include "examples/optimizer_flag.h"
#include "fsdp/fsdp.h"
#include "optim/diloco.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <optional>
#include <sstream>

namespace bench {
namespace {

int64_t proc_status_bytes(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(key) + ":";
  while (std::getline(f, line)) {
    if (line.rfind(prefix, 0) == 0) return std::stoll(line.substr(prefix.size())) * 1024;  // "  123 kB"
  }
  return -1;
}

struct ExpectedComm {
  int64_t elements = 0;     // as CommStats counts them
  double ring_bytes = 0.0;  // what this rank sends (and receives) per step in ring algorithms
};

/// What the library should communicate per step, from the parameters' shapes through the row
/// layout (fsdp/shard_layout.h) and the strategies' traits (fsdp/strategy.h): a unit gathered in
/// forward and again in backward counts 3x its padded size, gathered once (the root, ZeRO-2,
/// ZeRO-1) 2x, all-reduced 2x; hybrid adds the all-reduce of its shard across groups. Bytes in
/// the dtypes the unit gathers (param_dtype) and reduces (reduce_dtype) in; over S ranks a ring
/// moves (S-1)/S of a gather's or reduce-scatter's bytes through each rank, twice that for an
/// all-reduce (NCCL's bus-bandwidth accounting).
ExpectedComm expected_comm(const fsdp::FSDPModule& model, int world_size) {
  const auto specs = model.shard_specs();
  ExpectedComm c;
  auto ring = [](int64_t ranks) { return ranks > 1 ? static_cast<double>(ranks - 1) / static_cast<double>(ranks) : 0; };
  for (const auto& u : model.units()) {
    const fsdp::StrategyTraits& t = fsdp::traits(u.strategy);
    int64_t shard = 0;  // this unit's flat shard, from its parameters' layouts
    for (size_t i : u.specs) shard += specs[i].layout.padded_numel();
    const int64_t S = u.shard_world_size, padded = shard * S;
    const auto gather_bytes = static_cast<double>(padded * c10::elementSize(u.param_dtype));
    const auto reduce_bytes = static_cast<double>(padded * c10::elementSize(u.reduce_dtype));
    if (t.reduction == fsdp::GradReduction::kAllReduceBuckets) {
      c.elements += 2 * padded;
      c.ring_bytes += 2 * ring(world_size) * reduce_bytes;
      continue;
    }
    const int64_t gathers = t.reshard_after_forward && !u.name.empty() ? 2 : 1;
    c.elements += (gathers + 1) * padded;
    c.ring_bytes += ring(S) * (static_cast<double>(gathers) * gather_bytes + reduce_bytes);
    if (t.reduction == fsdp::GradReduction::kReduceScatterAllReduce && world_size > S) {
      c.elements += 2 * shard;
      c.ring_bytes += 2 * ring(world_size / S) * reduce_bytes / static_cast<double>(S);
    }
  }
  return c;
}

/// Bytes cuBLAS keeps on `device` once it has run: its workspaces, which the caching allocator
/// hands it on the first matrix products of a stream and which stay for the process's life. The
/// products run here, before the model exists, so that a step's allocator bytes can be told
/// apart from them.
double cublas_workspace_bytes(const torch::Device& device) {
  if (!device.is_cuda()) return 0;
  examples::synchronize(device);
  const int64_t before = fsdp::memory::stats(device).current_bytes;
  {
    at::NoGradGuard no_grad;
    auto x = torch::ones({64, 64}, torch::TensorOptions().device(device));
    auto y = at::addmm(x, x, x.t());  // cuBLASLt's path (a linear with its bias)
    y = at::mm(y.t(), x);             // cuBLAS's
    examples::synchronize(device);
  }
  return static_cast<double>(fsdp::memory::stats(device).current_bytes - before);
}

}  // namespace

int64_t peak_rss_bytes() {
  return proc_status_bytes("VmHWM");
}
int64_t rss_bytes() {
  return proc_status_bytes("VmRSS");
}
int64_t mem_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return -1;
}

Report run_rank(const RunOptions& o, const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  TORCH_CHECK(fsdp::memory::cpu_counting_enabled(), "bench::run_rank: enable the counting allocator first");
  const int rank = pg->getRank(), world = pg->getSize();
  TORCH_CHECK(o.batch_size % world == 0, "fsdp_bench (rank ", rank, "): --batch-size ", o.batch_size,
              " is not divisible by the ", world, " ranks");
  Report r;
  r["base_rss_bytes"] = static_cast<double>(rss_bytes());
  TORCH_CHECK(o.device == "cpu" || o.device == "cuda", "fsdp_bench (rank ", rank, "): device '", o.device,
              "' is neither cpu nor cuda");
  const torch::Device device = o.device == "cuda" ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  const double workspace = cublas_workspace_bytes(device);  // 0 on the CPU
  if (device.is_cuda()) r["cublas_workspace_bytes"] = workspace;

  auto options = fsdp::FullyShardOptions()
                     .strategy(gpt::strategy_flags().at(o.strategy))  // --diloco comes with hybrid
                     .shard_group_size(o.shard_group_size)
                     .prefetch(o.prefetch)
                     .bucket_bytes(static_cast<int64_t>(o.bucket_mb * 1024 * 1024))
                     .mixed_precision(examples::mixed_precision_policy(o));
  if (device.is_cuda()) options.device(device);  // each unit moves to the GPU as it is built
  if (o.timeout_s)
    options.timeout(std::chrono::milliseconds(std::max<int64_t>(1, std::llround(*o.timeout_s * 1000.0))));
  r["collective_timeout_s"] = static_cast<double>(options.timeout().count()) / 1000.0;
  fsdp::memory::reset_peak();
  fsdp::memory::reset_peak(device);
  torch::manual_seed(static_cast<int64_t>(o.seed));
  auto model = o.build_sharded ? [&] {
    fsdp::ShardingScope scope(pg, options);
    return fsdp::fully_shard(gpt::make_gpt<true>(o.model), scope);
  }()
                               : fsdp::fully_shard(gpt::make_gpt<true>(o.model), pg, options);
  r["construction_peak_bytes"] = static_cast<double>(fsdp::memory::stats(device).peak_bytes);
  if (device.is_cuda()) r["host_construction_peak_bytes"] = static_cast<double>(fsdp::memory::stats().peak_bytes);
  const ModelShape shape = gpt_shape(o.model);
  TORCH_CHECK(model.num_parameters() == shape.psi, "fsdp_bench: the GPT has ", model.num_parameters(),
              " parameters but bench::gpt_shape counts ", shape.psi, "; keep them in step");
  r["params"] = static_cast<double>(shape.psi);
  const ExpectedComm comm = expected_comm(model, world);
  r["comm_expected"] = static_cast<double>(comm.elements);
  r["comm_send_bytes"] = comm.ring_bytes;
  r["comm_recv_bytes"] = comm.ring_bytes;  // a ring passes on as much as it takes in

  const std::unique_ptr<torch::optim::Optimizer> opt_ptr = examples::make_optimizer(o.optimizer, model, 1e-3, 0.1);
  torch::optim::Optimizer& opt = *opt_ptr;
  std::optional<fsdp::optim::DiLoCo> diloco;
  if (o.diloco) diloco.emplace(model, opt, fsdp::optim::DiLoCoOptions(1));
  // DiLoCo's outer state (global shards, outer momentum) is model state too.
  auto outer_bytes = [&]() -> int64_t {
    return diloco ? fsdp::optim::state_bytes(diloco->global_shards(), &diloco->outer_optimizer()).total() : 0;
  };
  // fp16 scales the loss (what a real fp16 run does, one small all-reduce per step); bf16 needs none.
  fsdp::optim::ShardedGradScaler scaler(model, fsdp::optim::GradScalerOptions().enabled(o.mixed_precision == "fp16"));
  if (o.steps == 1) {
    // A single measured step (simulated ranks): allocate the optimizer state first, with one
    // AdamW step on zero gradients, so that the step holds it throughout, as every step after the
    // first does in training.
    for (auto& p : model.parameters()) p.mutable_grad() = torch::zeros_like(p);
    opt.step();
  }
  const int64_t T = o.model.block_size, rows = o.batch_size / world;
  double total_ms = 0, peak = 0, state_peak = 0, cached = 0;
  auto token = torch::zeros({1});
  for (int64_t step = 0; step < o.steps; ++step) {
    fsdp::all_reduce(pg, token);  // every rank starts the step together (a barrier)
    opt.zero_grad();
    model.reset_comm_stats();
    examples::synchronize(device);  // the step's time and peak are its own
    fsdp::memory::reset_peak(device);
    model.track_state_peak(true);
    const auto t0 = std::chrono::steady_clock::now();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed * 1000003 + static_cast<uint64_t>(step));
    auto tokens =
        torch::randint(o.model.vocab_size, {o.batch_size, T + 1}, gen, torch::kLong).narrow(0, rank * rows, rows);
    tokens = tokens.to(device);
    auto x = tokens.narrow(1, 0, T), y = tokens.narrow(1, 1, T);
    auto loss = torch::nn::functional::cross_entropy(model(x).flatten(0, 1), y.flatten());
    scaler.scale(loss).backward();
    if (diloco) {
      diloco->step([&] { scaler.step(opt); });
    } else {
      scaler.step(opt);
    }
    scaler.update();
    examples::synchronize(device);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const auto at_step = fsdp::optim::state_bytes(model.parameters(), &opt);
    model.track_state_peak(false);
    r["loss"] = loss.item<double>();
    const int64_t outer = outer_bytes();
    r["state_bytes_at_step"] = static_cast<double>(at_step.total() + outer);
    r["comm_elements"] = static_cast<double>(model.comm_stats().elements);
    // Parameters and gradients at their peak in forward and backward, plus the optimizer state,
    // which is there throughout (from the first step on); or the state at the step, if larger.
    const double step_state =
        static_cast<double>(std::max(model.state_peak_bytes() + at_step.optimizer, at_step.total()) + outer);
    const bool measured = step > 0 || o.steps == 1;  // the first of several warms up
    if (measured) {
      total_ms += ms;
      peak = std::max(peak, static_cast<double>(fsdp::memory::stats(device).peak_bytes));
      state_peak = std::max(state_peak, step_state);
      cached = std::max(cached, static_cast<double>(model.buffer_cache_stats().cached_bytes));
    }
  }
  const int64_t measured_steps = o.steps > 1 ? o.steps - 1 : 1;
  r["step_ms"] = total_ms / static_cast<double>(measured_steps);
  r["peak_bytes"] = peak;
  r["state_bytes_peak"] = state_peak;
  r["cached_bytes"] = cached;
  r["cached_cap_bytes"] = static_cast<double>(model.buffer_cache_stats().cap_bytes);
  r["peak_rss_bytes"] = static_cast<double>(peak_rss_bytes());
  // What is neither model state, the library's buffers nor cuBLAS's: activations and temporaries.
  r["other_bytes_peak"] = peak - state_peak - cached - workspace;
  r["activation_checkpointing"] = static_cast<double>(o.model.checkpoint_every);
  return r;
}

void write_report(const Report& report, const std::string& path) {
  std::ofstream f(path);
  f.precision(17);
  for (const auto& [k, v] : report) f << k << " " << v << "\n";
  TORCH_CHECK(f.good(), "fsdp_bench: cannot write ", path);
}

Report read_report(const std::string& path) {
  std::ifstream f(path);
  TORCH_CHECK(f, "fsdp_bench: the worker wrote no report ", path);
  Report r;
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream in(line);
    std::string k;
    double v = 0;
    TORCH_CHECK(static_cast<bool>(in >> k >> v), "fsdp_bench: malformed line '", line, "' in ", path);
    r[k] = v;
  }
  return r;
}

}  // namespace bench
