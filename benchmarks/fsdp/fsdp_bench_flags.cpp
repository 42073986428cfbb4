// fsdp_bench's flags (fsdp_bench_flags.h): a programs/flags.h table with the run flags shared
// with train_gpt, every value checked before any run starts; a bad one exits 2 naming the flag.
#include "benchmarks/fsdp/fsdp_bench_flags.h"

#include "examples/device_flag.h"
#include "examples/optimizer_flag.h"
#include "examples/run_flags.h"
#include "examples/strategy_flags.h"
#include "programs/flags.h"

#include <algorithm>

namespace bench {
namespace {

using fsdp::programs::usage_error;

const char* const kAbout =
    "  Every strategy at every world size (ranks on this machine, Gloo over loopback), then PyTorch's FSDP2\n"
    "  (fully_shard, the same model) at the same world sizes.\n"
    "  fsdp_bench --simulate [--sim-models 7b,70b] [--sim-world-sizes 8,64,1024] [--device cpu|cuda]: large\n"
    "  GPTs, one rank.\n";

const char* const kNotes =
    "  --world-sizes: default 1,2,4, and 8 with 8 cores or more where memory allows. --batch-size is global\n"
    "  (rows of --block-size tokens); the first of --steps warms up. --json prints the rows as JSON instead of\n"
    "  the table.\n"
    "  --simulate: rank 0 of N over a process group that communicates nothing; per-rank memory of large\n"
    "  GPTs where it fits this machine, the formulas alone where it does not. --device cuda: that rank on\n"
    "  this machine's GPU (each unit moved there as it is built), the CUDA allocator's bytes with cuBLAS's\n"
    "  workspace apart, its step time over two steps after a warm-up.\n"
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

}  // namespace

Args parse(int argc, char** argv) {
  Args a;
  // The default model: about 50M parameters, so that every run fits this 2-core machine.
  a.run.model.n_layer = 16;
  a.run.model.n_head = 8;
  a.run.model.n_embd = 512;
  a.run.batch_size = 8;
  a.run.steps = 4;
  a.run.seed = 1;
  fsdp::programs::Flags flags("fsdp_bench", kAbout);
  flags.toggle("--json", a.json, "the rows as JSON on stdout instead of the table")
      .text("--out", a.out, "the rows as JSON in FILE", "FILE.json")
      .text("--plot", a.plot, "an SVG of the rows", "FILE.svg")
      .integers("--world-sizes", a.world_sizes, 1, 1 << 20, "world sizes", &a.world_sizes_given)
      .names("--strategies", a.strategies, "strategies: full, grad-op, optimizer, replicate, hybrid, diloco")
      .names("--precisions", a.precisions, "fp32, bf16, fp16 (or one, --mixed-precision)", &a.precisions_given);
  examples::add_run_flags(flags, a.run);
  examples::add_optimizer_flag(flags, a.run.optimizer, /*with_sgd=*/false);
  flags.toggle("--no-fsdp2", a.fsdp2, "no PyTorch FSDP2 runs", false)
      .text("--python", a.python, "the Python that runs FSDP2", "PYTHON")
      .integer("--run-timeout", a.run_timeout_s, 1, int64_t{30} * 86400, "wall clock of each run", "SECONDS")
      .toggle("--simulate", a.simulate, "one simulated rank of large GPTs")
      .names("--sim-models", a.sim_models, "--simulate's models (7b, 70b; tiny: a test's size)")
      .integers("--sim-world-sizes", a.sim_world_sizes, 1, 1 << 20, "--simulate's world sizes")
      .choice("--device", a.device, {"cpu", "cuda"}, "where --simulate's rank trains (cuda: this machine's GPU)")
      .text("--worker", a.worker, "this process is one rank of a run: rank or sim")
      .hidden()
      .text("--report", a.report, "a worker's report file")
      .hidden()
      .toggle("--diloco", a.run.diloco, "a worker's flag: the diloco row's rank")
      .hidden()
      .notes(kNotes);
  flags.parse(argc, argv);
  for (const auto& s : a.strategies) {
    if (!known_row(s)) usage_error("unknown strategy '" + s + "' in --strategies");
  }
  // --mixed-precision (train_gpt's flag) is one precision; --precisions several.
  if (!a.precisions_given && !a.run.mixed_precision.empty()) a.precisions = {a.run.mixed_precision};
  for (const auto& p : a.precisions) {
    if (p != "fp32" && p != "bf16" && p != "fp16")
      usage_error("unknown precision '" + p + "' in --precisions (fp32, bf16, fp16)");
  }
  for (int n : a.world_sizes) {
    const int S = a.run.shard_group_size;
    const bool groups =
        std::any_of(a.strategies.begin(), a.strategies.end(), [](const std::string& s) { return hybrid_row(s); });
    if (S > 0 && groups && n % std::min(S, n) != 0) {
      usage_error("--shard-group-size " + std::to_string(S) + " does not divide world size " + std::to_string(n) +
                  " (hybrid's groups must tile the ranks)");
    }
  }
  if (a.device == "cuda" && !a.simulate && a.worker != "sim") {
    usage_error(
        "--device cuda is for --simulate's rank; fsdp_bench's multi-rank runs are processes over Gloo on the CPU. "
        "Add --simulate, or leave --device out.");
  }
  examples::check_device_flag(a.device);  // exit 2 naming CUDA where there is none
  a.run.device = a.device;
  if (a.run_timeout_s == 0) a.run_timeout_s = a.simulate ? 3600 : 900;
  examples::check_run_flags(a.run);
  a.run.model.wrap = examples::wrap_of(a.run, gpt::Wrap::kBlocks);  // --simulate: torchtitan's (fsdp_bench.cpp)
  if (a.run.steps < 2 && a.worker.empty()) usage_error("--steps must be at least 2 (the first warms up)");
  return a;
}

}  // namespace bench
