// A unit's lifecycle as explicit states with checked transitions: a step taken out of order is an
// internal error naming the unit and both states, not a silent mix of half-set flags.
//
//   kSharded ──begin_unshard──▶ kGathering ──unshard──▶ kUnsharded ──reshard──▶ kSharded
//      │                            │                    │    ▲
//      └─────────unshard────────────┼───────────────────▶│    │ pre_backward / next forward
//                                   └──drop_prefetch──▶ kSharded
//                                                        ▼    │
//                                          post_forward: kKeptForBackward ──reshard──▶ kSharded
//
// Alongside, the unit's part in backward: kIdle → kAwaiting (its outputs hooked) → kRunning (its
// gradients arriving) → kIdle.
#pragma once

#include <c10/util/Exception.h>

#include <string>

namespace fsdp::detail {

enum class UnitState {
  kSharded,          ///< parameters point at their shards; no gathered memory (sharded strategies)
  kGathering,        ///< an all-gather issued ahead (prefetch); parameters still at their shards
  kUnsharded,        ///< gathered; parameters point at their full views (the unit's forward or backward runs)
  kKeptForBackward,  ///< gathered memory kept for backward, parameters back at their shards
};

enum class BackwardPhase {
  kIdle,      ///< no backward expected
  kAwaiting,  ///< its outputs are hooked: its backward will begin
  kRunning,   ///< its backward began; its gradients are arriving
};

inline const char* to_string(UnitState s) {
  switch (s) {
    case UnitState::kSharded:
      return "sharded";
    case UnitState::kGathering:
      return "gathering";
    case UnitState::kUnsharded:
      return "unsharded";
    case UnitState::kKeptForBackward:
      return "kept for backward";
  }
  return "?";
}

/// Whether a unit may go from `from` to `to` (staying is always allowed).
inline bool allowed(UnitState from, UnitState to) {
  if (from == to) return true;
  switch (from) {
    case UnitState::kSharded:
      return to == UnitState::kGathering || to == UnitState::kUnsharded;
    case UnitState::kGathering:
      return to == UnitState::kUnsharded || to == UnitState::kSharded;
    case UnitState::kUnsharded:
      return to == UnitState::kSharded || to == UnitState::kKeptForBackward;
    case UnitState::kKeptForBackward:
      // Gathering again: ZeRO-1's full parameters, refreshed by a second forward before backward.
      return to == UnitState::kUnsharded || to == UnitState::kSharded || to == UnitState::kGathering;
  }
  return false;
}

/// Moves `state` to `to`, or fails naming the unit and both states.
inline void transition(UnitState& state, UnitState to, const std::string& unit) {
  TORCH_INTERNAL_ASSERT(allowed(state, to), "fsdp: unit '", unit, "' cannot go from ", to_string(state), " to ",
                        to_string(to));
  state = to;
}

}  // namespace fsdp::detail
