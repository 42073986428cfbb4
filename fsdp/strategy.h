// Sharding strategies as traits: one table says, per strategy, what it shards, when it gathers,
// how gradients are reduced, and what it costs (the ZeRO formulas). The library's units, the
// benchmark, the tests and docs/strategies.md all read it from here.
#pragma once

#include "fsdp/export.h"

#include <array>
#include <cstdint>
#include <string>

FSDP_PUBLIC_BEGIN

namespace fsdp {

/// How much of the model state is sharded (DeepSpeed's ZeRO stages, FSDP's names). StrategyTraits
/// below says exactly what each one does.
enum class ShardingStrategy {
  kFullShard,            ///< ZeRO-3
  kShardGradOp,          ///< ZeRO-2 in FSDP's sense
  kShardOptimizerState,  ///< ZeRO-1
  kNoShard,              ///< replicated (DDP)
  kHybridShard,          ///< ZeRO-3 inside groups of S ranks, replicated across them
};

/// The ranks a unit's parameters are split over.
enum class ShardOver {
  kWorld,  ///< all N ranks
  kGroup,  ///< groups of S consecutive ranks (FullyShardOptions::shard_group_size)
  kNone,   ///< not split: every rank holds every row
};

/// How a unit's gradients are combined over ranks in backward.
enum class GradReduction {
  kReduceScatter,           ///< each rank receives the sum of its rows
  kReduceScatterAllReduce,  ///< reduce-scatter in the group, then all-reduce across groups
  kAllReduceBuckets,        ///< all-reduce in buckets of FullyShardOptions::bucket_bytes
};

/// Model-state bytes per parameter on one rank: `full` bytes for each of the Ψ parameters plus
/// `sharded` bytes for each of the Ψ/D this rank holds (D: the ranks the strategy shards over).
struct StateCoefficients {
  double full = 0;
  double sharded = 0;
};

/// StrategyTraits' yes/no properties, named where the table below sets them.
enum StrategyFlag : unsigned {
  kParamsSharded = 1u << 0,
  kReshardAfterForward = 1u << 1,
  kGradsSharded = 1u << 2,
  kOptimizerSharded = 1u << 3,
  kPeakAddsGathered = 1u << 4,
  kCommAcrossGroups = 1u << 5,
};

/// The formulas of a strategy as text ("16Ψ/N", ...), as docs/strategies.md shows them.
struct StrategyFormulas {
  const char* at_step;
  const char* peak;
  const char* comm;
  const char* peak_mixed;
};

struct StrategyTraits {
  constexpr StrategyTraits(ShardingStrategy strategy, const char* name, const char* zero, ShardOver shard_over,
                           unsigned flags, GradReduction reduction, StateCoefficients at_step, StateCoefficients peak,
                           int comm_psi, StrategyFormulas formulas)
      : strategy(strategy),
        name(name),
        zero(zero),
        shard_over(shard_over),
        params_sharded((flags & kParamsSharded) != 0),
        reshard_after_forward((flags & kReshardAfterForward) != 0),
        grads_sharded((flags & kGradsSharded) != 0),
        optimizer_sharded((flags & kOptimizerSharded) != 0),
        reduction(reduction),
        at_step(at_step),
        peak(peak),
        peak_adds_gathered((flags & kPeakAddsGathered) != 0),
        comm_psi(comm_psi),
        comm_across_groups((flags & kCommAcrossGroups) != 0),
        formula_at_step(formulas.at_step),
        formula_peak(formulas.peak),
        formula_comm(formulas.comm),
        formula_peak_mixed(formulas.peak_mixed) {}

  ShardingStrategy strategy;
  const char* name;  ///< "full-shard", ...: messages and logs
  const char* zero;  ///< its name elsewhere: ZeRO stage, PyTorch FSDP
  ShardOver shard_over;
  /// Between steps only this rank's rows of each parameter exist (else full parameters are kept
  /// on every rank and the shard is a slice of them).
  bool params_sharded;
  /// Resharded after a unit's forward and gathered again for its backward (else the gathered
  /// parameters stay from forward to the end of backward).
  bool reshard_after_forward;
  /// Sharded gradients only (else each rank keeps full gradients too).
  bool grads_sharded;
  /// Optimizer state sharded (the optimizer sees this rank's rows only).
  bool optimizer_sharded;
  GradReduction reduction;
  /// Model state at the optimizer step and at its peak during the step, fp32 with Adam (4
  /// parameter + 4 gradient + 8 optimizer bytes per parameter). `peak_adds_gathered`: the peak also
  /// holds the units gathered at once (the root, kept from its forward into backward, and two of
  /// the largest other units: the one computing and the one prefetched), 4 bytes per parameter.
  /// With sharded gradients the peak in backward also holds full gradients before their reduction:
  /// the root's (an upper bound: all of them, though an embedding's arrives last), the unit's that
  /// backward is computing, and one unit's gradients packed for the reduce-scatter or in flight
  /// (a unit finishes the previous reduction before packing its own), in reduce_dtype.
  StateCoefficients at_step;
  StateCoefficients peak;
  bool peak_adds_gathered;
  /// Elements sent per step in the ZeRO paper's unit (all-gather outputs + reduce-scatter inputs +
  /// twice each all-reduce): `comm_psi` times Ψ, plus, for hybrid across its N/S groups, 2Ψ/S.
  int comm_psi;
  bool comm_across_groups;
  const char* formula_at_step;  ///< the formulas as text: "16Ψ/N", ...
  const char* formula_peak;
  const char* formula_comm;
  /// The peak with mixed precision (param_dtype of 2 bytes: what is held gathered is half the
  /// size; fp32 master, sharded gradients and moments unchanged, so at_step is too). "" where
  /// the strategy refuses mixed-precision compute (it keeps full parameters, not a cast copy).
  const char* formula_peak_mixed;
};

/// Indexed by ShardingStrategy. Each row: strategy, names, what it shards over, its flags, how
/// gradients are reduced, model-state bytes per parameter at the step and at the peak ({full,
/// sharded}), elements sent per step (times Ψ), the formulas.
// clang-format off
inline constexpr std::array<StrategyTraits, 5> kStrategies{{
  {ShardingStrategy::kFullShard, "full-shard", "ZeRO-3, FULL_SHARD / FSDP2 reshard_after_forward=True",
   ShardOver::kWorld, kParamsSharded | kReshardAfterForward | kGradsSharded | kOptimizerSharded | kPeakAddsGathered,
   GradReduction::kReduceScatter, {0, 16}, {0, 16}, 3,
   {"16Ψ/N", "16Ψ/N + 4(2Ψr + 4Ψu)", "3Ψ", "16Ψ/N + 2(2Ψr + 3Ψu) + 4Ψu"}},
  {ShardingStrategy::kShardGradOp, "shard-grad-op", "ZeRO-2, SHARD_GRAD_OP / FSDP2 reshard_after_forward=False",
   ShardOver::kWorld, kParamsSharded | kGradsSharded | kOptimizerSharded,
   GradReduction::kReduceScatter, {0, 16}, {4, 12}, 2,
   {"16Ψ/N", "4Ψ + 12Ψ/N + 4(Ψr + 2Ψu)", "2Ψ", "2Ψ + 12Ψ/N + 2(Ψr + Ψu) + 4Ψu"}},
  {ShardingStrategy::kShardOptimizerState, "shard-optimizer-state", "ZeRO-1 (llm.c's pattern)",
   ShardOver::kWorld, kOptimizerSharded, GradReduction::kReduceScatter, {8, 8}, {8, 8}, 2,
   {"8Ψ + 8Ψ/N", "8Ψ + 8Ψ/N", "2Ψ", ""}},
  {ShardingStrategy::kNoShard, "no-shard", "replicated, DDP / NO_SHARD", ShardOver::kNone, 0u,
   GradReduction::kAllReduceBuckets, {16, 0}, {16, 0}, 2, {"16Ψ", "16Ψ", "2Ψ", ""}},
  {ShardingStrategy::kHybridShard, "hybrid-shard", "ZeRO-3 in groups of S, HYBRID_SHARD / FSDP2 2-D mesh",
   ShardOver::kGroup,
   kParamsSharded | kReshardAfterForward | kGradsSharded | kOptimizerSharded | kPeakAddsGathered | kCommAcrossGroups,
   GradReduction::kReduceScatterAllReduce, {0, 16}, {0, 16}, 3,
   {"16Ψ/S", "16Ψ/S + 4(2Ψr + 4Ψu)", "3Ψ + 2Ψ/S", "16Ψ/S + 2(2Ψr + 3Ψu) + 4Ψu"}},
}};
// clang-format on

/// Whether `s` is one of the strategies above (an integer cast to the enum may not be).
constexpr bool is_valid(ShardingStrategy s) {
  return static_cast<size_t>(s) < kStrategies.size();
}

/// The traits of `s` (a valid strategy: fully_shard checks the options' and units' first).
constexpr const StrategyTraits& traits(ShardingStrategy s) {
  return kStrategies[is_valid(s) ? static_cast<size_t>(s) : 0];
}

/// "full-shard", "shard-grad-op", "shard-optimizer-state", "no-shard" or "hybrid-shard".
constexpr const char* to_string(ShardingStrategy s) {
  return traits(s).name;
}

/// The strategy whose `name` is `text` ("full-shard", ...); false when none is.
bool strategy_from_string(const std::string& text, ShardingStrategy& out);

/// The sizes the formulas take: Ψ (all parameters), the root unit's and the largest other unit's
/// parameters, N ranks and hybrid's group size S (N when not hybrid).
struct FormulaInputs {
  double psi = 0, root = 0, largest_unit = 0;  ///< Ψ, the root unit's and the largest other unit's parameters
  int world_size = 1, group_size = 1;          ///< N, and S (N when not hybrid)
  /// Bytes of a gathered parameter element: 4 (fp32), or 2 with a bf16/fp16 mixed-precision
  /// param_dtype. The master shards, gradients and moments stay fp32 either way.
  double param_bytes = 4;
  /// Bytes of a gradient element packed for the reduction: reduce_dtype's (4 unless set).
  double reduce_bytes = 4;
  /// Semi-synchronous training's outer state (fsdp::optim::LocalSGD, DiLoCo) per parameter this
  /// rank holds, added to the state at the step and at its peak: kDiLoCoOuterBytes for DiLoCo
  /// with outer momentum, 4 without it (the fp32 global shards alone), 0 for LocalSGD (none).
  double outer_bytes = 0;
};

/// DiLoCo's outer state per parameter a rank holds: an fp32 global shard and the outer Nesterov
/// momentum, 4 + 4 bytes (8Ψ/S with hybrid sharding's groups of S).
inline constexpr double kDiLoCoOuterBytes = 8;

/// Model-state bytes per rank at the optimizer step (traits.at_step, plus the outer state).
double state_bytes_at_step(ShardingStrategy s, const FormulaInputs& in);
/// Model-state bytes per rank at their peak during the step (traits.peak, plus the gathered units
/// and, with sharded gradients, the full gradients of the root and of one unit and one unit's packed
/// gradients). With param_bytes < 4 (mixed precision), what a sharded strategy holds gathered
/// scales with it (kShardGradOp's full parameters, the gathered units of the others), and so do
/// the full gradients (autograd computes them in param_dtype); the packed ones are reduce_bytes.
double state_bytes_peak(ShardingStrategy s, const FormulaInputs& in);
/// Elements communicated per step (traits.comm_psi and comm_across_groups).
double comm_elements(ShardingStrategy s, const FormulaInputs& in);

}  // namespace fsdp

FSDP_PUBLIC_END
