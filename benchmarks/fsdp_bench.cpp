// Memory and speed of every sharding strategy against the ZeRO formulas and against PyTorch's own
// FSDP2, side by side in one run, plus a simulated rank of jobs too large for this machine.
//
//   build/benchmarks/fsdp_bench                      # table on stdout, progress on stderr
//   build/benchmarks/fsdp_bench --json --out r.json --plot r.svg
//   build/benchmarks/fsdp_bench --simulate           # 7B and 70B GPTs at 8, 64 and 1024 ranks
//
// Each run starts its ranks as processes over Gloo on loopback (the environment torchrun gives),
// each measuring itself (bench_run.h); PyTorch's side is benchmarks/fsdp2_gpt.py with the same
// model, batch, optimizer and backend, its memory counted by this library's allocator loaded into
// Python. Simulated runs train one step on rank 0 of N over fsdp::make_fake_process_group.
#include "benchmarks/bench_launch.h"
#include "benchmarks/bench_report.h"
#include "benchmarks/bench_run.h"
#include "examples/cli.h"
#include "fsdp/fsdp.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>

#ifndef FSDP_BENCH_PYTHON
#define FSDP_BENCH_PYTHON ""
#endif
#ifndef FSDP_BENCH_FSDP2_SCRIPT
#define FSDP_BENCH_FSDP2_SCRIPT "benchmarks/fsdp2_gpt.py"
#endif
#ifndef FSDP_BENCH_LIBRARY
#define FSDP_BENCH_LIBRARY ""
#endif

namespace {

struct Args {
  bench::RunOptions run;
  std::vector<int> world_sizes = {1, 2, 4};  // and 8 where it fits (8 cores or more, and memory)
  bool world_sizes_given = false;
  std::vector<std::string> strategies = {"full", "grad-op", "optimizer", "replicate", "hybrid"};
  /// fp32, and mixed precision's param_dtype (bf16, fp16; fp32 master weights): each strategy at
  /// each world size in each, side by side (strategies that refuse mixed precision are left out).
  std::vector<std::string> precisions = {"fp32"};
  bool precisions_given = false;
  bool fsdp2 = true;
  std::string python = FSDP_BENCH_PYTHON;
  bool json = false;
  std::string out, plot;
  int run_timeout_s = 0;  // wall clock per run; 0: 900 s, or 3600 s simulated (70B at 1024 ranks: 29 minutes here)
  bool simulate = false;
  std::vector<std::string> sim_models = {"7b", "70b"};
  std::vector<int> sim_world_sizes = {8, 64, 1024};
  std::string worker;  // "" | "rank" | "sim": this process is one rank of a run
  std::string report;  // worker: where to write the report
};

[[noreturn]] void usage(const std::string& error) {
  std::cerr
      << "fsdp_bench: " << error << "\n"
      << "usage: fsdp_bench [--json] [--out FILE.json] [--plot FILE.svg] [--world-sizes 1,2,4]\n"
      << "                  [--strategies full,grad-op,optimizer,replicate,hybrid] [--shard-group-size S]\n"
      << "                  [--precisions fp32,bf16,fp16 | --mixed-precision bf16]\n"
      << "                  [--n-layer 16] [--n-head 8] [--n-embd 512] [--block-size 64] [--batch-size 8]\n"
      << "                  [--steps 4] [--seed 1] [--prefetch 1] [--bucket-mb 25] [--build-sharded]\n"
      << "                  [--no-fsdp2] [--python PYTHON] [--run-timeout SECONDS] [--timeout SECONDS]\n"
      << "       fsdp_bench --simulate [--sim-models 7b,70b] [--sim-world-sizes 8,64,1024] [--json] [--out FILE]\n"
      << "  Every strategy at every world size (ranks on this machine, Gloo over loopback), then PyTorch's FSDP2\n"
      << "  (fully_shard, the same model) at the same world sizes (default 1,2,4, and 8 with 8 cores or more\n"
      << "  where memory allows). --batch-size is global (rows of --block-size\n"
      << "  tokens); the first of --steps warms up. --json prints the rows as JSON instead of the table.\n"
      << "  --simulate: rank 0 of N over a process group that communicates nothing; per-rank memory of large\n"
      << "  GPTs where it fits this machine, the formulas alone where it does not.\n"
      << "  --run-timeout: wall-clock limit of each run (default 900 s, 3600 s with --simulate), then its ranks\n"
      << "  are stopped. --timeout: every rank's collective timeout, fractions allowed (default: the library's,\n"
      << "  $FSDP_TIMEOUT or 600 s; PyTorch's for FSDP2).\n";
  std::exit(2);
}

template <typename T>
std::vector<T> split(const std::string& v, T (*conv)(const std::string&)) {
  std::vector<T> out;
  std::stringstream s(v);
  std::string item;
  while (std::getline(s, item, ',')) out.push_back(conv(item));
  if (out.empty()) throw std::invalid_argument("empty list");
  return out;
}
int to_int(const std::string& s) {
  return std::stoi(s);
}
std::string to_str(const std::string& s) {
  return s;
}

Args parse(int argc, char** argv) {
  Args a;
  // The default model: about 50M parameters, so that every run fits this 2-core machine.
  a.run.model.n_layer = 16;
  a.run.model.n_head = 8;
  a.run.model.n_embd = 512;
  a.run.batch_size = 8;
  a.run.steps = 4;
  a.run.seed = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") usage("help");
    if (k == "--json" || k == "--no-fsdp2" || k == "--simulate") {
      (k == "--json" ? a.json : k == "--simulate" ? a.simulate : a.fsdp2) = k != "--no-fsdp2";
      continue;
    }
    // The value of a flag; never the next flag (a negative number has one dash).
    auto value = [&]() -> std::string {
      if (i + 1 >= argc || std::string(argv[i + 1]).rfind("--", 0) == 0) usage("missing value after " + k);
      return argv[++i];
    };
    try {
      // The flags shared with train_gpt: examples/run_flags.h.
      if (cli::parse_run_flag(k, value, a.run)) continue;
      if (k == "--world-sizes")
        a.world_sizes = split<int>(value(), to_int), a.world_sizes_given = true;
      else if (k == "--strategies")
        a.strategies = split<std::string>(value(), to_str);
      else if (k == "--precisions")
        a.precisions = split<std::string>(value(), to_str), a.precisions_given = true;
      else if (k == "--python")
        a.python = value();
      else if (k == "--out")
        a.out = value();
      else if (k == "--plot")
        a.plot = value();
      else if (k == "--run-timeout")
        a.run_timeout_s = static_cast<int>(cli::parse_int(k, value(), 1, int64_t{30} * 86400));
      else if (k == "--sim-models")
        a.sim_models = split<std::string>(value(), to_str);
      else if (k == "--sim-world-sizes")
        a.sim_world_sizes = split<int>(value(), to_int);
      else if (k == "--worker")
        a.worker = value();
      else if (k == "--report")
        a.report = value();
      else
        usage("unknown flag " + k);
    } catch (const std::logic_error&) {
      usage("bad value for " + k);
    } catch (const cli::InputError& e) {
      usage(e.what());
    }
  }
  for (const auto& s : a.strategies) {
    if (gpt::strategy_flags().count(s) == 0) usage("unknown strategy '" + s + "' in --strategies");
  }
  // --mixed-precision (train_gpt's flag) is one precision; --precisions several.
  if (!a.precisions_given && !a.run.mixed_precision.empty()) a.precisions = {a.run.mixed_precision};
  for (const auto& p : a.precisions) {
    if (p != "fp32" && p != "bf16" && p != "fp16")
      usage("unknown precision '" + p + "' in --precisions (fp32, bf16, fp16)");
  }
  for (int n : a.world_sizes) {
    if (n < 1) usage("--world-sizes must be positive");
    const int S = a.run.shard_group_size;
    if (S > 0 && std::count(a.strategies.begin(), a.strategies.end(), "hybrid") > 0 && n % std::min(S, n) != 0) {
      usage("--shard-group-size " + std::to_string(S) + " does not divide world size " + std::to_string(n) +
            " (hybrid's groups must tile the ranks)");
    }
  }
  for (int n : a.sim_world_sizes) {
    if (n < 1) usage("--sim-world-sizes must be positive");
  }
  if (a.run_timeout_s == 0) a.run_timeout_s = a.simulate ? 3600 : 900;
  try {
    cli::check_run_flags(a.run);
  } catch (const cli::InputError& e) {
    usage(e.what());
  }
  if (a.run.steps < 2 && a.worker.empty()) usage("--steps must be at least 2 (the first warms up)");
  return a;
}

/// Model arguments shared by both workers (the C++ worker takes the run's own flags too).
std::vector<std::string> model_args(const Args& a) {
  const auto& m = a.run.model;
  return {"--n-layer",    std::to_string(m.n_layer),        "--n-head",     std::to_string(m.n_head),
          "--n-embd",     std::to_string(m.n_embd),         "--block-size", std::to_string(m.block_size),
          "--batch-size", std::to_string(a.run.batch_size), "--steps",      std::to_string(a.run.steps),
          "--seed",       std::to_string(a.run.seed)};
}

/// --timeout for the ranks, C++ and Python alike, when one was given.
std::vector<std::string> timeout_args(const Args& a) {
  if (!a.run.timeout_s) return {};
  return {"--timeout", cli::json_number(*a.run.timeout_s, "%.17g")};
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
    usage("unknown --sim-models entry '" + name + "' (7b, 70b)");
  }
  return c;
}

bool g_failed_runs = false;  // a simulated run that should have fitted failed: exit status 1

std::vector<bench::Row> simulate(const Args& a) {
  std::vector<bench::Row> rows;
  const int64_t available = bench::mem_available_bytes();
  int k = 0;
  const int total = static_cast<int>(a.sim_models.size() * a.sim_world_sizes.size());
  for (const auto& name : a.sim_models) {
    const gpt::Config c = sim_model(name);
    const bench::ModelShape m = bench::gpt_shape(c);
    for (int N : a.sim_world_sizes) {
      ++k;
      bench::Row r;
      r.impl = "simulated";
      r.strategy = "full";
      r.model = name;
      r.world_size = N;
      r.shard_group_size = N;
      r.params = m.psi;
      r.formula_at_step = bench::formula_at_step("full", m, N, N);
      r.formula_peak = bench::formula_peak("full", m, N, N);
      r.comm_formula = bench::comm_formula("full", m, N, N);
      const double need = bench::rank_need_bytes("full", m, c, N, N, 1, /*build_sharded=*/true);
      if (available > 0 && need > 0.85 * static_cast<double>(available)) {
        r.measured = false;
        char note[160];
        std::snprintf(note, sizeof(note), "formula only: needs ~%.1f GiB, this machine has %.1f GiB available",
                      need / (1 << 30), static_cast<double>(available) / (1 << 30));
        r.note = note;
        std::fprintf(stderr, "[%2d/%d] simulated %s N=%d: %s\n", k, total, name.c_str(), N, note);
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
                name};
      for (auto& x : timeout_args(a)) l.argv.push_back(x);
      l.threads_per_rank = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      l.run_timeout_s = a.run_timeout_s;
      char progress[32];
      std::snprintf(progress, sizeof(progress), "[%2d/%d]", k, total);
      try {
        bench::Row got = aggregate("simulated", "full", "fp32", N, N, m, bench::launch(l, progress));
        got.model = name;
        got.note = "measured on rank 0 of " + std::to_string(N);
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
      usage("--batch-size " + std::to_string(a.run.batch_size) + " is not divisible by world size " +
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
    return precision == "fp32" || fsdp::traits(gpt::strategy_flags().at(s)).params_sharded;
  };
  int total = 0;
  for (const auto& p : a.precisions) {
    for (const auto& s : a.strategies) total += runs_in(s, p) ? static_cast<int>(worlds.size()) : 0;
    total += fsdp2 ? static_cast<int>(worlds.size()) : 0;
  }
  std::fprintf(
      stderr,
      "fsdp_bench: GPT of %lld parameters (%lld blocks x %lld wide), global batch %lld x %lld, "
      "%lld steps (the first warms up), %d runs%s\n",
      static_cast<long long>(m.psi), static_cast<long long>(a.run.model.n_layer),
      static_cast<long long>(a.run.model.n_embd), static_cast<long long>(a.run.batch_size),
      static_cast<long long>(a.run.model.block_size), static_cast<long long>(a.run.steps), total,
      a.run.timeout_s ? (", collective timeout " + cli::json_number(*a.run.timeout_s, "%g") + " s").c_str() : "");
  // One run: its ranks launched, their reports aggregated into a row.
  int k = 0;
  auto run = [&](const std::string& impl, const std::string& s, const std::string& precision, int N, int S,
                 std::vector<std::string> argv) {
    bench::Launch l;
    l.label = impl + " " + s + (precision == "fp32" ? "" : " " + precision) + " N=" + std::to_string(N) +
              (s == "hybrid" ? " S=" + std::to_string(S) : "");
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
        const int S = s == "hybrid" ? hybrid_group(a, N) : (s == "replicate" ? 1 : N);
        std::vector<std::string> argv = {bench::self_exe(),
                                         "--worker",
                                         "rank",
                                         "--report",
                                         "{out}",
                                         "--strategy",
                                         s,
                                         "--shard-group-size",
                                         std::to_string(S),
                                         "--prefetch",
                                         std::to_string(a.run.prefetch),
                                         "--bucket-mb",
                                         std::to_string(a.run.bucket_mb)};
        if (a.run.build_sharded) argv.emplace_back("--build-sharded");
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
    o.strategy = "full";
    const int N = a.sim_world_sizes.at(0);
    o.batch_size = N;  // one row on this rank
    o.steps = 1;
    o.build_sharded = true;
    o.timeout_s = a.run.timeout_s;
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
  const Args a = parse(argc, argv);
  try {
    if (!a.worker.empty()) return run_worker(a);
    std::vector<bench::Row> rows;
    if (a.simulate) {
      rows = simulate(a);
    } else {
      rows = run_all(a);
    }
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
      TORCH_CHECK(f.good(), "fsdp_bench: cannot write ", a.out);
    }
    if (!a.plot.empty()) bench::write_svg(rows, a.plot);
    if (g_failed_runs) return 1;
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
