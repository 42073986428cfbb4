// The flags train_gpt and fsdp_bench share (the model, the batch, the run and how it is sharded),
// parsed and checked one way, with examples/cli.h's strict value parsers: a value out of range, a
// trailing character or a missing value is the same error in both programs.
#pragma once

#include "examples/cli.h"
#include "examples/gpt.h"
#include "examples/strategy_flags.h"
#include "fsdp/mixed_precision.h"

#include <climits>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace cli {

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

/// Takes `flag` when it is one of RunFlags' (its value from `value()`, which the program gives;
/// --build-sharded takes none, --activation-checkpointing an optional one: `has_value()` says
/// whether the next argument is a value) and returns true; false for any other flag.
inline bool parse_run_flag(
    const std::string& flag, const std::function<std::string()>& value, RunFlags& f,
    const std::function<bool()>& has_value = [] { return false; }) {
  constexpr int64_t kIntMax = INT_MAX;
  const std::string& k = flag;
  if (k == "--build-sharded") {
    f.build_sharded = true;
  } else if (k == "--activation-checkpointing") {
    f.model.checkpoint_every = has_value() ? parse_int(k, value(), 1, kIntMax) : 1;
  } else if (k == "--steps") {
    f.steps = parse_int(k, value(), 1);
  } else if (k == "--batch-size") {
    f.batch_size = parse_int(k, value(), 1);
  } else if (k == "--seed") {
    f.seed = parse_uint64(k, value());
  } else if (k == "--n-layer") {
    f.model.n_layer = parse_int(k, value(), 1, kIntMax);
  } else if (k == "--n-head") {
    f.model.n_head = parse_int(k, value(), 1, kIntMax);
  } else if (k == "--n-embd") {
    f.model.n_embd = parse_int(k, value(), 1, kIntMax);
  } else if (k == "--block-size") {
    f.model.block_size = parse_int(k, value(), 1, kIntMax);
  } else if (k == "--prefetch") {
    f.prefetch = static_cast<int>(parse_int(k, value(), 0, kIntMax));
  } else if (k == "--strategy") {
    f.strategy = value();
  } else if (k == "--shard-group-size") {
    f.shard_group_size = static_cast<int>(parse_int(k, value(), 1, kIntMax));
  } else if (k == "--bucket-mb") {
    f.bucket_mb = parse_double(k, value(), 0, false, 1 << 20);
  } else if (k == "--timeout") {
    f.timeout_s = parse_double(k, value(), 0, false, 365 * 86400.0);
  } else if (k == "--mixed-precision") {
    f.mixed_precision = value();
  } else if (k == "--wrap") {
    f.wrap = value();
    if (f.wrap.empty()) throw InputError("--wrap must be blocks or torchtitan, not ''", true);
  } else {
    return false;
  }
  return true;
}

/// What single values cannot say: the embedding a multiple of the heads, a known strategy.
inline void check_run_flags(const RunFlags& f) {
  if (f.model.n_embd % f.model.n_head != 0) {
    throw InputError("--n-embd " + std::to_string(f.model.n_embd) + " must be a multiple of --n-head " +
                         std::to_string(f.model.n_head),
                     true);
  }
  if (!f.mixed_precision.empty() && f.mixed_precision != "bf16" && f.mixed_precision != "fp16") {
    throw InputError("--mixed-precision must be bf16 or fp16, not '" + f.mixed_precision + "'", true);
  }
  if (!f.wrap.empty() && f.wrap != "blocks" && f.wrap != "torchtitan") {
    throw InputError("--wrap must be blocks or torchtitan, not '" + f.wrap + "'", true);
  }
  if (gpt::strategy_flags().count(f.strategy) == 0) {
    throw InputError("--strategy must be full, grad-op, optimizer, replicate or hybrid, not '" + f.strategy + "'",
                     true);
  }
}

}  // namespace cli
