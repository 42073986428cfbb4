// fsdp_bench's flags (fsdp_bench_flags.h): examples/cli.h's strict parsers and the run flags shared
// with train_gpt, every value checked before any run starts; a bad one exits 2 naming the flag.
#include "benchmarks/fsdp_bench_flags.h"

#include "examples/cli.h"
#include "examples/run_flags.h"
#include "examples/strategy_flags.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>

namespace bench {
namespace {

const char* const kUsage =
    "usage: fsdp_bench [--json] [--out FILE.json] [--plot FILE.svg] [--world-sizes 1,2,4]\n"
    "                  [--strategies full,grad-op,optimizer,replicate,hybrid,diloco] [--shard-group-size S]\n"
    "                  [--precisions fp32,bf16,fp16 | --mixed-precision bf16]\n"
    "                  [--n-layer 16] [--n-head 8] [--n-embd 512] [--block-size 64] [--batch-size 8]\n"
    "                  [--steps 4] [--seed 1] [--prefetch 1] [--bucket-mb 25] [--build-sharded]\n"
    "                  [--activation-checkpointing [K]] [--wrap blocks|torchtitan]\n"
    "                  [--no-fsdp2] [--python PYTHON] [--run-timeout SECONDS] [--timeout SECONDS]\n"
    "       fsdp_bench --simulate [--sim-models 7b,70b] [--sim-world-sizes 8,64,1024] [--json] [--out FILE]\n"
    "                  [--wrap torchtitan|blocks]\n"
    "  Every strategy at every world size (ranks on this machine, Gloo over loopback), then PyTorch's FSDP2\n"
    "  (fully_shard, the same model) at the same world sizes (default 1,2,4, and 8 with 8 cores or more\n"
    "  where memory allows). --batch-size is global (rows of --block-size\n"
    "  tokens); the first of --steps warms up. --json prints the rows as JSON instead of the table.\n"
    "  --simulate: rank 0 of N over a process group that communicates nothing; per-rank memory of large\n"
    "  GPTs where it fits this machine, the formulas alone where it does not.\n"
    "  --run-timeout: wall-clock limit of each run (default 900 s, 3600 s with --simulate), then its ranks\n"
    "  are stopped. --timeout: every rank's collective timeout, fractions allowed (default: the library's,\n"
    "  $FSDP_TIMEOUT or 600 s; PyTorch's for FSDP2).\n"
    "  --activation-checkpointing [K]: every K-th block (default every one) recomputes its forward in\n"
    "  backward; FSDP2 gets torch.utils.checkpoint (non-reentrant) on the same blocks.\n"
    "  diloco (not in the default list): hybrid sharding with DiLoCo over its replicas at H = 1, the\n"
    "  outer state (fp32 global shards, outer momentum: 8Ψ/S) counted and in its formulas.\n"
    "  --wrap: the units, for both implementations: the blocks (the root keeps embeddings, final norm and\n"
    "  head; default), or torchtitan's (token embedding, each block, final norm with head; --simulate's default).\n"
    "  Exit status: 0 done, 2 bad flags, 1 a run that failed.\n";

// A comma-separated list of world sizes.
std::vector<int> int_list(const std::string& flag, const std::string& v) {
  const auto n = cli::parse_int_list(flag, v, 1, 1 << 20);
  return std::vector<int>(n.begin(), n.end());
}

// A comma-separated list of names, none empty.
std::vector<std::string> names(const std::string& flag, const std::string& v) {
  std::vector<std::string> out;
  for (size_t at = 0;;) {
    const size_t comma = v.find(',', at);
    out.push_back(v.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (out.back().empty()) cli::bad_value(flag, v, "a comma-separated list of names");
    if (comma == std::string::npos) return out;
    at = comma + 1;
  }
}

}  // namespace

[[noreturn]] void usage(const std::string& error) {
  std::cerr << "fsdp_bench: " << error << "\n" << kUsage;
  std::exit(cli::kUsageExit);
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
    if (k == "--help" || k == "-h") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (k == "--diloco") {  // a worker's flag: the diloco row's rank
      a.run.diloco = true;
      continue;
    }
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
      auto has_value = [&] { return i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0; };
      if (cli::parse_run_flag(k, value, a.run, has_value)) continue;
      if (k == "--world-sizes")
        a.world_sizes = int_list(k, value()), a.world_sizes_given = true;
      else if (k == "--strategies")
        a.strategies = names(k, value());
      else if (k == "--precisions")
        a.precisions = names(k, value()), a.precisions_given = true;
      else if (k == "--python")
        a.python = value();
      else if (k == "--out")
        a.out = value();
      else if (k == "--plot")
        a.plot = value();
      else if (k == "--run-timeout")
        a.run_timeout_s = static_cast<int>(cli::parse_int(k, value(), 1, int64_t{30} * 86400));
      else if (k == "--sim-models")
        a.sim_models = names(k, value());
      else if (k == "--sim-world-sizes")
        a.sim_world_sizes = int_list(k, value());
      else if (k == "--worker")
        a.worker = value();
      else if (k == "--report")
        a.report = value();
      else
        usage("unknown flag " + k);
    } catch (const cli::InputError& e) {
      usage(e.what());
    }
  }
  for (const auto& s : a.strategies) {
    if (!known_row(s)) usage("unknown strategy '" + s + "' in --strategies");
  }
  // --mixed-precision (train_gpt's flag) is one precision; --precisions several.
  if (!a.precisions_given && !a.run.mixed_precision.empty()) a.precisions = {a.run.mixed_precision};
  for (const auto& p : a.precisions) {
    if (p != "fp32" && p != "bf16" && p != "fp16")
      usage("unknown precision '" + p + "' in --precisions (fp32, bf16, fp16)");
  }
  for (int n : a.world_sizes) {
    const int S = a.run.shard_group_size;
    const bool groups =
        std::any_of(a.strategies.begin(), a.strategies.end(), [](const std::string& s) { return hybrid_row(s); });
    if (S > 0 && groups && n % std::min(S, n) != 0) {
      usage("--shard-group-size " + std::to_string(S) + " does not divide world size " + std::to_string(n) +
            " (hybrid's groups must tile the ranks)");
    }
  }
  if (a.run_timeout_s == 0) a.run_timeout_s = a.simulate ? 3600 : 900;
  try {
    cli::check_run_flags(a.run);
    a.run.model.wrap = cli::wrap_of(a.run, gpt::Wrap::kBlocks);  // --simulate: torchtitan's (fsdp_bench.cpp)
  } catch (const cli::InputError& e) {
    usage(e.what());
  }
  if (a.run.steps < 2 && a.worker.empty()) usage("--steps must be at least 2 (the first warms up)");
  return a;
}

}  // namespace bench
