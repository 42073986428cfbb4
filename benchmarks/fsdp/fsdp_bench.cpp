// Memory and speed of every sharding strategy against the ZeRO formulas and against PyTorch's own
// FSDP2, side by side in one run, plus a simulated rank of jobs too large for this machine.
//
//   build/benchmarks/fsdp_bench                      # table on stdout, progress on stderr
//   build/benchmarks/fsdp_bench --json --out r.json --plot r.svg
//   build/benchmarks/fsdp_bench --simulate           # 7B and 70B GPTs at 8, 64 and 1024 ranks
//
// Each run starts its ranks as processes over Gloo on loopback (the environment torchrun gives),
// each measuring itself (bench_run.h); PyTorch's side is benchmarks/fsdp/fsdp2_gpt.py with the same
// model, batch, optimizer and backend, its memory counted by this library's allocator loaded into
// Python. Simulated runs train one step on rank 0 of N over fsdp::make_fake_process_group.
#include "benchmarks/bench_launch.h"
#include "benchmarks/bench_run.h"
#include "benchmarks/fsdp/bench_report.h"
#include "benchmarks/fsdp/fsdp_bench_flags.h"
#include "fsdp/fsdp.h"
#include "programs/program.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <thread>

#ifndef FSDP_BENCH_FSDP2_SCRIPT
#define FSDP_BENCH_FSDP2_SCRIPT "benchmarks/fsdp/fsdp2_gpt.py"
#endif
#ifndef FSDP_BENCH_LIBRARY
#define FSDP_BENCH_LIBRARY ""
#endif

namespace {

using bench::Args;
using fsdp::programs::usage_error;

/// --wrap for the ranks (C++, FSDP2's script, a simulated rank), when given.
std::vector<std::string> wrap_args(const Args& a) {
  if (a.run.wrap.empty()) return {};
  return {"--wrap", a.run.wrap};
}

/// Model arguments shared by both workers (the C++ worker takes the run's own flags too).
std::vector<std::string> model_args(const Args& a) {
  const auto& m = a.run.model;
  std::vector<std::string> out = {
      "--n-layer",    std::to_string(m.n_layer),        "--n-head",     std::to_string(m.n_head),
      "--n-embd",     std::to_string(m.n_embd),         "--block-size", std::to_string(m.block_size),
      "--batch-size", std::to_string(a.run.batch_size), "--steps",      std::to_string(a.run.steps),
      "--seed",       std::to_string(a.run.seed),       "--optimizer",  a.run.optimizer};
  for (auto& x : wrap_args(a)) out.push_back(x);
  if (m.checkpoint_every > 0) {  // C++ and FSDP2 alike: every K-th block
    out.emplace_back("--activation-checkpointing");
    out.push_back(std::to_string(m.checkpoint_every));
  }
  return out;
}

std::string number_text(double v, const char* format) {
  char text[64];
  std::snprintf(text, sizeof(text), format, v);
  return text;
}

/// --timeout for the ranks, C++ and Python alike, when one was given.
std::vector<std::string> timeout_args(const Args& a) {
  if (!a.run.timeout_s) return {};
  return {"--timeout", number_text(*a.run.timeout_s, "%.17g")};
}

int hybrid_group(const Args& a, int N) {
  return a.run.shard_group_size > 0 ? std::min(a.run.shard_group_size, N) : std::max(1, N / 2);
}

bench::Row aggregate(const std::string& impl, const std::string& strategy, const std::string& precision, int N, int S,
                     const bench::ModelShape& m, const std::vector<bench::Report>& reports) {
  bench::Row r;
  r.impl = impl;
  r.strategy = strategy;
  r.precision = precision;
  r.model = "default";
  r.world_size = N;
  r.shard_group_size = S;
  r.params = m.psi;
  auto largest = [&](const char* key) {
    double v = -1;
    for (const auto& rep : reports) {
      auto it = rep.find(key);
      if (it != rep.end()) v = std::max(v, it->second);
    }
    return v;
  };
  r.peak_bytes = largest("peak_bytes");
  r.peak_rss_bytes = largest("peak_rss_bytes");
  r.base_rss_bytes = largest("base_rss_bytes");
  r.construction_peak_bytes = largest("construction_peak_bytes");
  r.state_bytes_at_step = largest("state_bytes_at_step");
  r.state_bytes_peak = largest("state_bytes_peak");
  r.cached_bytes = largest("cached_bytes");
  r.cached_cap_bytes = largest("cached_cap_bytes");
  r.step_ms = largest("step_ms");
  r.comm_elements = largest("comm_elements");
  r.comm_expected = largest("comm_expected");
  r.loss = reports.front().count("loss") ? reports.front().at("loss") : 0;
  r.collective_timeout_s = largest("collective_timeout_s");
  r.other_bytes_peak = largest("other_bytes_peak");
  r.cublas_workspace_bytes = largest("cublas_workspace_bytes");
  r.host_construction_peak_bytes = largest("host_construction_peak_bytes");
  r.comm_send_bytes = largest("comm_send_bytes");
  r.comm_recv_bytes = largest("comm_recv_bytes");
  r.activation_checkpointing = static_cast<int>(std::max(0.0, largest("activation_checkpointing")));
  const double param_bytes = precision == "fp32" ? 4 : 2;
  r.formula_at_step = bench::formula_at_step(strategy, m, N, S);
  r.formula_peak = bench::formula_peak(strategy, m, N, S, param_bytes);
  r.comm_formula = bench::comm_formula(strategy, m, N, S);
  return r;
}

/// The simulated models: GPTs shaped like the 7B and 70B classes (vocabulary 32000, 4x MLP).
gpt::Config sim_model(const std::string& name) {
  gpt::Config c;
  c.vocab_size = 32000;
  c.block_size = 16;  // a few tokens: the memory measured is the model state's
  if (name == "7b") {
    c.n_layer = 32, c.n_head = 32, c.n_embd = 4096;
  } else if (name == "70b") {
    c.n_layer = 86, c.n_head = 64, c.n_embd = 8192;
  } else if (name == "tiny") {  // for tests: blocks outweigh the root, as in the large presets
    c.vocab_size = 256, c.n_layer = 4, c.n_head = 2, c.n_embd = 64;
  } else {
    usage_error("unknown --sim-models entry '" + name + "' (7b, 70b, or tiny: a test's size)");
  }
  return c;
}

/// A formula-only row's note: "formula only: needs ~X GiB, <who> has Y GiB <what>".
std::string does_not_fit(double need, double have, const char* who, const char* what) {
  char note[160];
  std::snprintf(note, sizeof(note), "formula only: needs ~%.1f GiB, %s has %.1f GiB %s", need / (1 << 30), who,
                have / (1 << 30), what);
  return note;
}

bool g_failed_runs = false;  // a simulated run that should have fitted failed: exit status 1

std::vector<bench::Row> simulate(const Args& a) {
  std::vector<bench::Row> rows;
  const int64_t available = bench::mem_available_bytes();
  int k = 0;
  const int total = static_cast<int>(a.sim_models.size() * a.sim_world_sizes.size());
  for (const auto& name : a.sim_models) {
    gpt::Config c = sim_model(name);
    c.wrap = examples::wrap_of(a.run, gpt::Wrap::kTorchtitan);
    const bench::ModelShape m = bench::gpt_shape(c);
    for (int N : a.sim_world_sizes) {
      ++k;
      bench::Row r;
      r.impl = "simulated";
      r.strategy = "full";
      r.model = name;
      r.device = a.device;
      r.world_size = N;
      r.shard_group_size = N;
      r.params = m.psi;
      r.formula_at_step = bench::formula_at_step("full", m, N, N);
      r.formula_peak = bench::formula_peak("full", m, N, N);
      r.comm_formula = bench::comm_formula("full", m, N, N);
      const double need = bench::rank_need_bytes("full", m, c, N, N, 1, /*build_sharded=*/true);
      // On the GPU the worker weighs the need against the device's free memory itself (the
      // driver leaves CUDA alone); the host then holds one unit at a time on its way there.
      if (a.device == "cpu" && available > 0 && need > 0.85 * static_cast<double>(available)) {
        r.measured = false;
        r.note = does_not_fit(need, static_cast<double>(available), "this machine", "available");
        std::fprintf(stderr, "[%2d/%d] simulated %s N=%d: %s\n", k, total, name.c_str(), N, r.note.c_str());
        rows.push_back(r);
        continue;
      }
      bench::Launch l;
      l.label = "simulated " + name + " N=" + std::to_string(N);
      l.argv = {bench::self_exe(),
                "--worker",
                "sim",
                "--report",
                "{out}",
                "--n-layer",
                std::to_string(c.n_layer),
                "--n-head",
                std::to_string(c.n_head),
                "--n-embd",
                std::to_string(c.n_embd),
                "--sim-world-sizes",
                std::to_string(N),
                "--sim-models",
                name,
                "--device",
                a.device};
      for (auto& x : timeout_args(a)) l.argv.push_back(x);
      for (auto& x : wrap_args(a)) l.argv.push_back(x);
      l.threads_per_rank = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      l.run_timeout_s = a.run_timeout_s;
      char progress[32];
      std::snprintf(progress, sizeof(progress), "[%2d/%d]", k, total);
      try {
        const std::vector<bench::Report> reports = bench::launch(l, progress);
        if (const auto& rep = reports.front(); rep.count("device_free_bytes") && !rep.count("loss")) {
          r.measured = false;  // the worker found it would not fit the GPU
          r.note = does_not_fit(rep.at("need_bytes"), rep.at("device_free_bytes"), "the GPU", "free");
          rows.push_back(r);
          continue;
        }
        bench::Row got = aggregate("simulated", "full", "fp32", N, N, m, reports);
        got.model = name;
        got.device = a.device;
        got.note = "measured on rank 0 of " + std::to_string(N) + (a.device == "cuda" ? " on the GPU" : "");
        rows.push_back(got);
      } catch (const c10::Error& e) {  // e.g. out of memory after all: the formula, and why
        const std::string why = e.what_without_backtrace();
        std::fprintf(stderr, "%s\n", why.c_str());
        r.measured = false;
        r.note = "formula only: the simulated run failed: " + why.substr(0, why.find('\n'));
        rows.push_back(r);
        g_failed_runs = true;
      }
    }
  }
  return rows;
}

/// Every strategy at every world size, then FSDP2 at each world size; checked first, all of it.
std::vector<bench::Row> run_all(const Args& a) {
  std::vector<bench::Row> rows;
  const bench::ModelShape m = bench::gpt_shape(a.run.model);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  bool fsdp2 = a.fsdp2;
  if (fsdp2 && (a.python.empty() || access(a.python.c_str(), X_OK) != 0)) {
    std::fprintf(stderr,
                 "fsdp_bench: no Python with torch ('%s'); skipping PyTorch FSDP2 (pass --python, or --no-fsdp2)\n",
                 a.python.c_str());
    fsdp2 = false;
  }
  // Every run is checked before the first starts: nothing is left half measured. By default 8
  // ranks join where they fit: as many cores, and the memory (else they are left out, said so).
  std::vector<int> worlds = a.world_sizes;
  const bool try_eight = !a.world_sizes_given && cores >= 8 && a.run.batch_size % 8 == 0;
  if (try_eight) worlds.push_back(8);
  const int64_t available = bench::mem_available_bytes();
  for (size_t w = 0; w < worlds.size(); ++w) {  // by index: 8 may be dropped on the way
    const int N = worlds[w];
    if (a.run.batch_size % N != 0) {
      usage_error("--batch-size " + std::to_string(a.run.batch_size) + " is not divisible by world size " +
                  std::to_string(N) + " (each rank takes an equal share)");
    }
    for (const auto& s : a.strategies) {
      const double need = N * bench::rank_need_bytes(s, m, a.run.model, N, hybrid_group(a, N), a.run.batch_size / N,
                                                     a.run.build_sharded);
      if (available > 0 && need > 0.9 * static_cast<double>(available)) {
        if (try_eight && N == 8) {
          std::fprintf(stderr, "fsdp_bench: leaving out 8 ranks: %s would need about %.1f GiB\n", s.c_str(),
                       need / (1 << 30));
          worlds.pop_back();
          break;
        }
        char msg[512];
        std::snprintf(msg, sizeof(msg),
                      "fsdp_bench: %s at N=%d would need about %.1f GiB (%d ranks x %.1f GiB: %lld parameters, "
                      "activations of %lld rows, the process) but %.1f GiB is available. Choose a smaller model "
                      "(--n-embd, --n-layer), a smaller --batch-size or fewer --world-sizes.",
                      s.c_str(), N, need / (1 << 30), N, need / N / (1 << 30), static_cast<long long>(m.psi),
                      static_cast<long long>(a.run.batch_size / N), static_cast<double>(available) / (1 << 30));
        throw std::runtime_error(msg);
      }
    }
  }
  // Strategies that keep full parameters refuse mixed-precision compute (fsdp/strategy.h).
  auto runs_in = [](const std::string& s, const std::string& precision) {
    return precision == "fp32" || fsdp::traits(bench::sharding_of(s)).params_sharded;
  };
  // DiLoCo needs two replicas at least (N / S of hybrid's groups): one would send nothing to anyone.
  auto group_of = [&](const std::string& s, int N) {
    return bench::hybrid_row(s) ? hybrid_group(a, N) : (s == "replicate" ? 1 : N);
  };
  auto runs_at = [&](const std::string& s, int N) { return s != bench::kDiLoCo || N / group_of(s, N) >= 2; };
  int total = 0;
  for (const auto& p : a.precisions) {
    for (const auto& s : a.strategies) {
      for (int N : worlds) total += runs_in(s, p) && runs_at(s, N) ? 1 : 0;
    }
    total += fsdp2 ? static_cast<int>(worlds.size()) : 0;
  }
  if (total == 0) {
    usage_error(
        "nothing to run: every strategy asked for is left out at these world sizes (diloco needs N / S >= 2, a "
        "mixed precision a sharded strategy)");
  }
  std::fprintf(stderr,
               "fsdp_bench: GPT of %lld parameters (%lld blocks x %lld wide), global batch %lld x %lld, "
               "%lld steps (the first warms up), %d runs%s\n",
               static_cast<long long>(m.psi), static_cast<long long>(a.run.model.n_layer),
               static_cast<long long>(a.run.model.n_embd), static_cast<long long>(a.run.batch_size),
               static_cast<long long>(a.run.model.block_size), static_cast<long long>(a.run.steps), total,
               a.run.timeout_s ? (", collective timeout " + number_text(*a.run.timeout_s, "%g") + " s").c_str() : "");
  // One run: its ranks launched, their reports aggregated into a row.
  int k = 0;
  auto run = [&](const std::string& impl, const std::string& s, const std::string& precision, int N, int S,
                 std::vector<std::string> argv) {
    bench::Launch l;
    l.label = impl + " " + s + (precision == "fp32" ? "" : " " + precision) + " N=" + std::to_string(N) +
              (bench::hybrid_row(s) ? " S=" + std::to_string(S) : "");
    if (precision != "fp32") {
      argv.emplace_back("--mixed-precision");
      argv.push_back(precision);
    }
    l.argv = std::move(argv);
    for (auto& x : model_args(a)) l.argv.push_back(x);
    for (auto& x : timeout_args(a)) l.argv.push_back(x);
    l.world_size = N;
    l.threads_per_rank = static_cast<int>(std::max(1u, cores / static_cast<unsigned>(N)));
    l.run_timeout_s = a.run_timeout_s;
    char progress[32];
    std::snprintf(progress, sizeof(progress), "[%2d/%d]", ++k, total);
    rows.push_back(aggregate(impl, s, precision, N, S, m, bench::launch(l, progress)));
  };
  for (const auto& precision : a.precisions) {
    for (const auto& s : a.strategies) {
      if (!runs_in(s, precision)) {
        std::fprintf(stderr, "fsdp_bench: %s left out in %s: it keeps full parameters, so it refuses mixed precision\n",
                     s.c_str(), precision.c_str());
        continue;
      }
      for (int N : worlds) {
        const int S = group_of(s, N);
        if (!runs_at(s, N)) {
          std::fprintf(stderr, "fsdp_bench: diloco left out at N=%d: hybrid's groups of %d make one replica\n", N, S);
          continue;
        }
        std::vector<std::string> argv = {bench::self_exe(),
                                         "--worker",
                                         "rank",
                                         "--report",
                                         "{out}",
                                         "--strategy",
                                         s == bench::kDiLoCo ? "hybrid" : s,
                                         "--shard-group-size",
                                         std::to_string(S),
                                         "--prefetch",
                                         std::to_string(a.run.prefetch),
                                         "--bucket-mb",
                                         std::to_string(a.run.bucket_mb)};
        if (a.run.build_sharded) argv.emplace_back("--build-sharded");
        if (s == bench::kDiLoCo) argv.emplace_back("--diloco");
        run("libtorch-fsdp", s, precision, N, S, std::move(argv));
      }
    }
    for (int N : fsdp2 ? worlds : std::vector<int>{}) {
      run("pytorch-fsdp2", "full", precision, N, N,
          {a.python, FSDP_BENCH_FSDP2_SCRIPT, "--counting-lib", FSDP_BENCH_LIBRARY, "--report", "{out}"});
    }
  }
  return rows;
}

int run_worker(const Args& a) {
  fsdp::memory::enable_cpu_counting();
  bench::Report rep;
  if (a.worker == "sim") {
    bench::RunOptions o;
    o.model = sim_model(a.sim_models.at(0));
    o.model.wrap = examples::wrap_of(a.run, gpt::Wrap::kTorchtitan);
    o.strategy = "full";
    const int N = a.sim_world_sizes.at(0);
    o.batch_size = N;  // one row on this rank
    o.build_sharded = true;
    o.timeout_s = a.run.timeout_s;
    o.device = a.device;
    // On the CPU one step measures memory; on the GPU the first of three warms up (cuBLAS, the
    // allocator's first blocks), so that the step time is the rank's compute.
    o.steps = a.device == "cuda" ? 3 : 1;
    if (a.device == "cuda") {
      const double need =
          bench::rank_need_bytes("full", bench::gpt_shape(o.model), o.model, N, N, 1, /*build_sharded=*/true);
      const auto free = static_cast<double>(c10::getDeviceAllocator(c10::kCUDA)->getMemoryInfo(0).first);
      if (need > 0.9 * free) {  // formula only, said so by the driver
        bench::write_report({{"need_bytes", need}, {"device_free_bytes", free}}, a.report);
        return 0;
      }
    }
    rep = bench::run_rank(o, fsdp::make_fake_process_group(0, N));
  } else {
    bench::RunOptions o = a.run;
    fsdp::InitOptions init;
    if (o.timeout_s) init.timeout(std::chrono::milliseconds(std::max<int64_t>(1, std::llround(*o.timeout_s * 1000.0))));
    rep = bench::run_rank(o, fsdp::init_process_group(init));
  }
  bench::write_report(rep, a.report);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::programs::Program("fsdp_bench").main([&] {
    const Args a = bench::parse(argc, argv);
    if (!a.worker.empty()) return run_worker(a);
    const std::vector<bench::Row> rows = a.simulate ? simulate(a) : run_all(a);
    if (a.json) {
      std::cout << bench::to_json(rows);
    } else if (a.simulate) {
      bench::print_simulated(rows);
    } else {
      bench::print_table(rows);
      bench::print_fsdp2_ratios(rows);
    }
    if (!a.out.empty()) {
      std::ofstream f(a.out);
      f << bench::to_json(rows);
      TORCH_CHECK(f.good(), "cannot write ", a.out);
    }
    if (!a.plot.empty()) bench::write_svg(rows, a.plot);
    return g_failed_runs ? 1 : 0;
  });
}
