// The flags train_gpt and fsdp_bench share (the model, the batch, the run and how it is sharded),
// added to each program's flag table (programs/flags.h) and checked one way: a value out of range, a
// trailing character or a missing value is the same error in both programs.
#pragma once

#include "examples/gpt.h"
#include "examples/strategy_flags.h"
#include "fsdp/mixed_precision.h"
#include "programs/flags.h"

#include <climits>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

namespace examples {

struct RunFlags {
  gpt::Config model;
  int64_t steps = 50;
  int64_t batch_size = 12;  // global rows
  uint64_t seed = 1;
  int prefetch = 1;
  std::string strategy = "full";    // full | grad-op | optimizer | replicate | hybrid (fsdp/strategy.h's flags)
  int shard_group_size = 0;         // hybrid: ranks per group; 0: the program's default
  double bucket_mb = 25;            // replicate: all-reduce bucket size
  bool build_sharded = false;       // shard each block while it is built (fsdp::ShardingScope)
  std::optional<double> timeout_s;  // collective timeout; unset: the library's default
  std::string mixed_precision;      // "" (fp32), "bf16" or "fp16": the units' param_dtype, fp32 master weights
  // --activation-checkpointing [K]: every K-th block recomputes its forward in backward (model.checkpoint_every).
  std::string wrap;  // "blocks", "torchtitan" (gpt::Wrap), or "" for the program's default
};

/// The wrapping --wrap names, or `fallback` (the program's default) without the flag.
inline gpt::Wrap wrap_of(const RunFlags& f, gpt::Wrap fallback) {
  if (f.wrap.empty()) return fallback;
  return f.wrap == "torchtitan" ? gpt::Wrap::kTorchtitan : gpt::Wrap::kBlocks;
}

/// The policy --mixed-precision names (fsdp/mixed_precision.h): compute and all-gather in bf16 or
/// fp16, gradients reduced in fp32; none for "".
inline fsdp::MixedPrecisionPolicy mixed_precision_policy(const RunFlags& f) {
  fsdp::MixedPrecisionPolicy p;
  if (f.mixed_precision == "bf16") p.param_dtype(at::kBFloat16);
  if (f.mixed_precision == "fp16") p.param_dtype(at::kHalf);
  return p;
}

/// RunFlags' flags in a program's table (--build-sharded a switch, --activation-checkpointing an
/// optional value).
inline void add_run_flags(fsdp::programs::Flags& flags, RunFlags& f) {
  constexpr int64_t kIntMax = INT_MAX;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  flags.integer("--steps", f.steps, 1, kMax, "training steps")
      .integer("--batch-size", f.batch_size, 1, kMax, "the global batch, in rows", "B")
      .seed("--seed", f.seed, "the seed of the weights and the data order")
      .integer("--n-layer", f.model.n_layer, 1, kIntMax, "blocks", "L")
      .integer("--n-head", f.model.n_head, 1, kIntMax, "attention heads", "H")
      .integer("--n-embd", f.model.n_embd, 1, kIntMax, "the embedding width, a multiple of --n-head", "C")
      .integer("--block-size", f.model.block_size, 1, kIntMax, "tokens per row", "T")
      .integer("--prefetch", f.prefetch, 0, kIntMax, "units all-gathered ahead", "K")
      .text("--strategy", f.strategy, "full, grad-op, optimizer, replicate or hybrid", "S")
      .integer("--shard-group-size", f.shard_group_size, 1, kIntMax, "hybrid: ranks per group", "S")
      .number("--bucket-mb", f.bucket_mb, 0, false, 1 << 20, "replicate: all-reduce bucket size", "MB")
      .toggle("--build-sharded", f.build_sharded, "shard each block while the model is built")
      .number("--timeout", f.timeout_s, 0, false, 365 * 86400.0, "collective timeout", "SECONDS")
      .text("--mixed-precision", f.mixed_precision, "bf16 or fp16 (fp32 master weights)", "P")
      .integer_or("--activation-checkpointing", f.model.checkpoint_every, int64_t{1}, 1, kIntMax,
                  "every K-th block recomputes its forward in backward (default every one)")
      .custom("--wrap", "W", "the units: torchtitan or blocks", [&f](const std::string& v) {
        if (v.empty()) fsdp::programs::usage_error("--wrap must be blocks or torchtitan, not ''");
        f.wrap = v;
      });
}

/// What single values cannot say: the embedding a multiple of the heads, a known strategy.
inline void check_run_flags(const RunFlags& f) {
  if (f.model.n_embd % f.model.n_head != 0) {
    fsdp::programs::usage_error("--n-embd " + std::to_string(f.model.n_embd) + " must be a multiple of --n-head " +
                                std::to_string(f.model.n_head));
  }
  if (!f.mixed_precision.empty() && f.mixed_precision != "bf16" && f.mixed_precision != "fp16") {
    fsdp::programs::usage_error("--mixed-precision must be bf16 or fp16, not '" + f.mixed_precision + "'");
  }
  if (!f.wrap.empty() && f.wrap != "blocks" && f.wrap != "torchtitan") {
    fsdp::programs::usage_error("--wrap must be blocks or torchtitan, not '" + f.wrap + "'");
  }
  if (gpt::strategy_flags().count(f.strategy) == 0) {
    fsdp::programs::usage_error("--strategy must be full, grad-op, optimizer, replicate or hybrid, not '" + f.strategy +
                                "'");
  }
}

}  // namespace examples
