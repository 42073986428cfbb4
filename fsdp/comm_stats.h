// Counts of what a wrapped model sent (FSDPModule::comm_stats).
#pragma once

#include <cstdint>

namespace fsdp {

/// What the library sent through the process group since the last reset. `elements` is the ZeRO
/// paper's communication volume: all-gather output + reduce-scatter input + 2 x all-reduce elements.
/// The small cross-rank checks (at each forward, backward and clipping call) are counted apart.
struct CommStats {
  int64_t all_gathers = 0;
  int64_t reduce_scatters = 0;
  int64_t all_reduces = 0;
  int64_t broadcasts = 0;
  int64_t elements = 0;
  int64_t checks = 0;
};

}  // namespace fsdp
