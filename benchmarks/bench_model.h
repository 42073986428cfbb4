// fsdp_bench's vocabulary: the ZeRO formulas it measures against, for the strategies named as
// train_gpt names them (examples/strategy_flags.h).
#pragma once

#include "examples/gpt.h"
#include "examples/strategy_flags.h"
#include "fsdp/strategy.h"

#include <algorithm>
#include <cstdint>
#include <string>

namespace bench {

/// The sizes that enter the formulas: Ψ, the root unit's and the largest other unit's parameters.
struct ModelShape {
  int64_t psi = 0;
  int64_t root = 0;
  int64_t largest_unit = 0;
};

/// examples/gpt.h's GPT. Wrap::kBlocks: each block is a unit, the root holds the embeddings, the
/// final LayerNorm and the head. Wrap::kTorchtitan: the token embedding, each block, and the final
/// LayerNorm with the head are units; the root holds the position embedding.
inline ModelShape gpt_shape(const gpt::Config& c) {
  const int64_t C = c.n_embd, b = c.bias ? 1 : 0;
  const int64_t block =
      2 * 2 * C + (3 * C * C + 3 * C * b) + (C * C + C * b) + (4 * C * C + 4 * C * b) + (4 * C * C + C * b);
  const int64_t wte = c.vocab_size * C, wpe = c.block_size * C, norm_head = 2 * C + C * c.vocab_size;
  const int64_t psi = wte + wpe + norm_head + c.n_layer * block;
  if (c.wrap == gpt::Wrap::kTorchtitan) return {psi, wpe, std::max({block, wte, norm_head})};
  return {psi, wte + wpe + norm_head, block};
}

/// fsdp_bench's row beyond the five strategies: hybrid sharding with fsdp::optim::DiLoCo over its
/// replicas at H = 1 (every step an outer step, so that every measured step holds the outer state
/// whole: fp32 global shards and the outer momentum, 8 bytes per parameter of the shard).
inline const std::string kDiLoCo = "diloco";

/// The sharding strategy of a row's name: a train_gpt flag name, or kDiLoCo (hybrid).
inline fsdp::ShardingStrategy sharding_of(const std::string& name) {
  return name == kDiLoCo ? fsdp::ShardingStrategy::kHybridShard : gpt::strategy_flags().at(name);
}
/// Whether a row's ranks form hybrid's groups of S (hybrid, diloco).
inline bool hybrid_row(const std::string& name) {
  return sharding_of(name) == fsdp::ShardingStrategy::kHybridShard;
}
inline bool known_row(const std::string& name) {
  return name == kDiLoCo || gpt::strategy_flags().count(name) > 0;
}

/// The formulas' inputs for `strategy` (a row name) at N ranks, hybrid groups of S.
inline fsdp::FormulaInputs formula_inputs(const std::string& strategy, const ModelShape& m, int N, int S,
                                          double param_bytes = 4) {
  const bool hybrid = hybrid_row(strategy);
  fsdp::FormulaInputs in{static_cast<double>(m.psi),
                         static_cast<double>(m.root),
                         static_cast<double>(m.largest_unit),
                         N,
                         hybrid ? S : N,
                         param_bytes};
  if (strategy == kDiLoCo) in.outer_bytes = fsdp::kDiLoCoOuterBytes;
  return in;
}

/// Model-state bytes per rank at the optimizer step, from the strategy's traits (fsdp/strategy.h).
inline double formula_at_step(const std::string& strategy, const ModelShape& m, int N, int S) {
  return fsdp::state_bytes_at_step(sharding_of(strategy), formula_inputs(strategy, m, N, S));
}

/// Model-state bytes per rank at their peak during the step (traits: SHARD_GRAD_OP holds every
/// parameter unsharded from forward to the end of backward; full sharding and hybrid hold their
/// shards plus the units gathered at once).
/// `param_bytes`: 2 with mixed precision (the gathered parameters' element size).
inline double formula_peak(const std::string& strategy, const ModelShape& m, int N, int S, double param_bytes = 4) {
  return fsdp::state_bytes_peak(sharding_of(strategy), formula_inputs(strategy, m, N, S, param_bytes));
}

inline std::string formula_text(const std::string& strategy, bool peak, const std::string& precision = "fp32") {
  const fsdp::StrategyTraits& t = fsdp::traits(sharding_of(strategy));
  const std::string outer = strategy == kDiLoCo ? " + 8Ψ/S" : "";  // DiLoCo's outer state
  if (!peak) return t.formula_at_step + outer;
  return (precision == "fp32" ? t.formula_peak : t.formula_peak_mixed) + outer;
}

/// The ZeRO paper's communication volume per step, in elements (traits). Counted at one rank too:
/// the library still issues the collectives (the process group's copy).
inline double comm_formula(const std::string& strategy, const ModelShape& m, int N, int S) {
  return fsdp::comm_elements(sharding_of(strategy), formula_inputs(strategy, m, N, S));
}

/// Activations of one rank's forward, fp32, as autograd keeps them: about 34·C + 5·heads·T values
/// per token per block (Korthikanti et al.), plus the logits and their softmax.
inline double activation_bytes(const gpt::Config& c, int64_t rows) {
  const double tokens = static_cast<double>(rows * c.block_size);
  return 4.0 * tokens *
         (static_cast<double>(c.n_layer) * (34.0 * c.n_embd + 5.0 * c.n_head * c.block_size) + 3.0 * c.vocab_size);
}

/// What one rank of a run needs at most (fsdp_bench's fit check): the whole model while it is built
/// (unless built sharded) or the step's peak state, plus activations and the process's own footprint.
inline double rank_need_bytes(const std::string& strategy, const ModelShape& m, const gpt::Config& c, int N, int S,
                              int64_t rows, bool build_sharded) {
  const double unit = 4.0 * static_cast<double>(m.largest_unit);
  const double state = formula_peak(strategy, m, N, S);  // gradients not yet reduced included
  const double build = build_sharded ? 4.0 * static_cast<double>(m.psi) / N + unit : 4.0 * static_cast<double>(m.psi);
  constexpr double kProcess = 600.0 * 1024 * 1024;  // LibTorch (or Python with torch) loaded
  return std::max(state + activation_bytes(c, rows), build) + kProcess;
}

}  // namespace bench
