// ckpt_bench's flags through examples/cli.h's strict parsers, so that a typo is an error naming the
// flag (exit status 2) rather than a silently different benchmark.
#include "benchmarks/ckpt_flags.h"

#include "examples/cli.h"
#include "examples/strategy_flags.h"

#include <climits>

namespace ckpt {

const char* const kUsage =
    "usage: ckpt_bench compare [--json] [--world-sizes 1,2,4] [--dir D] [--reps R] [--async-reps A]\n"
    "                          [--io-threads T] [--run-timeout SECONDS] [model flags]\n"
    "       ckpt_bench save|load --dir D [--reps R] [--io-threads T] [--direct] [--strategy S] [model flags]\n"
    "       ckpt_bench async --dir D [--async-reps A] [model flags]\n"
    "       ckpt_bench simulate [--ranks 128,256,512,1024] [model flags]\n"
    "  model flags: [--n-layer 8] [--n-embd 512] [--n-head 8] (a GPT, AdamW after one step)\n"
    "  save, load and async run as the ranks of a job (torchrun --no-python --nproc-per-node N ...);\n"
    "  rank 0 prints one JSON line per repetition (async: one in all) on stdout.\n"
    "  save: the checkpoint against each rank writing as many bytes to its own file (D/raw), fsynced.\n"
    "  load: D's latest checkpoint at this world size against reading as many bytes from D/raw; the\n"
    "  page cache is dropped before each.\n"
    "  async: AsyncSaver's stall against a synchronous save and a memcpy; steps during the write.\n"
    "  simulate: rank 0's assembly of the manifest at each number of simulated ranks, and its read.\n"
    "  compare: save (buffered and --direct), load, async and PyTorch DCP (benchmarks/dcp_bench.py) at\n"
    "  each world size (ranks started on this machine), then a resharding load to one rank fewer;\n"
    "  one JSON row (--json) or table line per world size on stdout, progress on stderr.\n"
    "  --reps: repetitions of save and load (default 6); --async-reps: asynchronous saves (default 20);\n"
    "  --io-threads: threads writing and reading (default 1); --direct: O_DIRECT writes;\n"
    "  --strategy: full (default), grad-op, optimizer, replicate or hybrid (groups of 2);\n"
    "  --run-timeout: wall clock of each of compare's runs (default 3600 s), then its ranks are stopped.\n"
    "  Exit status: 0 done, 2 bad flags, 1 other errors.\n";

Flags parse_flags(int argc, char** argv) {
  constexpr int64_t kIntMax = INT_MAX;
  Flags f;
  f.model.n_layer = 8;
  f.model.n_embd = 512;
  f.model.n_head = 8;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
      f.help = true;
      return f;
    }
  }
  if (argc < 2) throw cli::InputError("no mode: compare, save, load, async or simulate", true);
  f.mode = argv[1];
  if (f.mode != "compare" && f.mode != "save" && f.mode != "load" && f.mode != "async" && f.mode != "simulate") {
    throw cli::InputError("unknown mode '" + f.mode + "': compare, save, load, async or simulate", true);
  }
  auto ints = [](const std::vector<int64_t>& v) { return std::vector<int>(v.begin(), v.end()); };
  for (int i = 2; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--json" || k == "--direct") {
      (k == "--json" ? f.json : f.direct) = true;
      continue;
    }
    if (i + 1 >= argc) throw cli::InputError("missing value after " + k, true);
    const std::string v = argv[++i];
    if (k == "--dir") {
      if (v.empty()) cli::bad_value(k, v, "a directory");
      f.dir = v;
    } else if (k == "--n-layer") {
      f.model.n_layer = cli::parse_int(k, v, 1, kIntMax);
    } else if (k == "--n-head") {
      f.model.n_head = cli::parse_int(k, v, 1, kIntMax);
    } else if (k == "--n-embd") {
      f.model.n_embd = cli::parse_int(k, v, 1, kIntMax);
    } else if (k == "--strategy") {
      if (gpt::strategy_flags().count(v) == 0) cli::bad_value(k, v, "full, grad-op, optimizer, replicate or hybrid");
      f.strategy = v;
    } else if (k == "--reps") {
      f.reps = static_cast<int>(cli::parse_int(k, v, 1, 100000));
    } else if (k == "--async-reps") {
      f.async_reps = static_cast<int>(cli::parse_int(k, v, 1, 100000));
    } else if (k == "--io-threads") {
      f.io_threads = static_cast<int>(cli::parse_int(k, v, 1, 1024));
    } else if (k == "--run-timeout") {
      f.run_timeout_s = static_cast<int>(cli::parse_int(k, v, 1, int64_t{30} * 86400));
    } else if (k == "--world-sizes") {
      f.worlds = ints(cli::parse_int_list(k, v, 1, 4096));
    } else if (k == "--ranks") {
      f.ranks = ints(cli::parse_int_list(k, v, 1, 1 << 20));
    } else {
      throw cli::InputError("unknown flag " + k, true);
    }
  }
  if (f.model.n_embd % f.model.n_head != 0) {
    throw cli::InputError("--n-embd " + std::to_string(f.model.n_embd) + " must be a multiple of --n-head " +
                              std::to_string(f.model.n_head),
                          true);
  }
  if ((f.mode == "save" || f.mode == "load" || f.mode == "async") && f.dir.empty()) {
    throw cli::InputError(f.mode + " needs --dir D", true);
  }
  return f;
}

}  // namespace ckpt
