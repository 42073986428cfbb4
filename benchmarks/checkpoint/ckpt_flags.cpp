// ckpt_bench's flags: a programs/flags.h table, so that a typo is an error naming the flag (exit
// status 2) rather than a silently different benchmark.
#include "benchmarks/checkpoint/ckpt_flags.h"

#include "examples/strategy_flags.h"
#include "programs/flags.h"

#include <climits>

namespace ckpt {
namespace {

using fsdp::programs::usage_error;

const char* const kAbout =
    "  ckpt_bench MODE [flags], MODE one of:\n"
    "       ckpt_bench compare [--json] [--world-sizes 1,2,4] [--dir D] [--reps R] [--async-reps A]\n"
    "                          [--io-threads T] [--run-timeout SECONDS] [model flags]\n"
    "       ckpt_bench save|load --dir D [--reps R] [--io-threads T] [--direct] [--strategy S] [model flags]\n"
    "       ckpt_bench async --dir D [--async-reps A] [model flags]\n"
    "       ckpt_bench simulate [--ranks 128,256,512,1024] [model flags]\n"
    "  model flags: [--n-layer 8] [--n-embd 512] [--n-head 8] (a GPT, AdamW after one step)\n";

const char* const kNotes =
    "  save, load and async run as the ranks of a job (torchrun --no-python --nproc-per-node N ...);\n"
    "  rank 0 prints one JSON line per repetition (async: one in all) on stdout.\n"
    "  save: the checkpoint against each rank writing as many bytes to its own file (D/raw), fsynced.\n"
    "  load: D's latest checkpoint at this world size against reading as many bytes from D/raw; the\n"
    "  page cache is dropped before each.\n"
    "  async: AsyncSaver's stall against a synchronous save and a memcpy; steps during the write.\n"
    "  simulate: rank 0's assembly of the manifest at each number of simulated ranks, and its read.\n"
    "  compare: save (buffered and --direct), load, async and PyTorch DCP (benchmarks/checkpoint/dcp_bench.py) at\n"
    "  each world size (ranks started on this machine), then a resharding load to one rank fewer;\n"
    "  one JSON row (--json) or table line per world size on stdout, progress on stderr.\n"
    "  Exit status: 0 done, 2 bad flags, 1 other errors.\n";

fsdp::programs::Flags table(Flags& f) {
  constexpr int64_t kIntMax = INT_MAX;
  fsdp::programs::Flags flags("ckpt_bench", kAbout);
  flags.toggle("--json", f.json, "compare: JSON rows instead of the table")
      .toggle("--direct", f.direct, "O_DIRECT writes and reads, the library's and the raw baseline's")
      .text("--dir", f.dir, "the checkpoints' directory (compare: a temporary one by default)", "D", true)
      .integer("--n-layer", f.model.n_layer, 1, kIntMax, "blocks", "L")
      .integer("--n-head", f.model.n_head, 1, kIntMax, "attention heads", "H")
      .integer("--n-embd", f.model.n_embd, 1, kIntMax, "the embedding width, a multiple of --n-head", "C")
      .choice("--strategy", f.strategy, {"full", "grad-op", "optimizer", "replicate", "hybrid"},
              "how the model is sharded (hybrid: groups of 2)")
      .integer("--reps", f.reps, 1, 100000, "repetitions of save and load", "R")
      .integer("--async-reps", f.async_reps, 1, 100000, "asynchronous saves", "A")
      .integer("--io-threads", f.io_threads, 1, 1024, "threads writing and reading", "T")
      .integer("--run-timeout", f.run_timeout_s, 1, int64_t{30} * 86400, "wall clock of each of compare's runs",
               "SECONDS")
      .integers("--world-sizes", f.worlds, 1, 4096, "compare: world sizes")
      .integers("--ranks", f.ranks, 1, 1 << 20, "simulate: simulated ranks")
      .notes(kNotes);
  return flags;
}

}  // namespace

Flags parse_flags(int argc, char** argv) {
  Flags f;
  f.model.n_layer = 8;
  f.model.n_embd = 512;
  f.model.n_head = 8;
  const fsdp::programs::Flags flags = table(f);
  const std::string mode = argc > 1 ? argv[1] : "";
  const bool known = mode == "compare" || mode == "save" || mode == "load" || mode == "async" || mode == "simulate";
  flags.answer_help(argc, argv);
  if (mode.empty()) usage_error("no mode: compare, save, load, async or simulate");
  if (!known) usage_error("unknown mode '" + mode + "': compare, save, load, async or simulate");
  flags.parse(argc, argv, 2);
  f.mode = mode;
  if (f.model.n_embd % f.model.n_head != 0) {
    usage_error("--n-embd " + std::to_string(f.model.n_embd) + " must be a multiple of --n-head " +
                std::to_string(f.model.n_head));
  }
  if ((f.mode == "save" || f.mode == "load" || f.mode == "async") && f.dir.empty()) {
    usage_error(f.mode + " needs --dir D");
  }
  return f;
}

}  // namespace ckpt
