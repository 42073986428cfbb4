// Counts of what a wrapped model sent (FSDPModule::comm_stats) and of its buffer reuse
// (FSDPModule::buffer_cache_stats).
#pragma once

#include "fsdp/export.h"

#include <cstdint>

FSDP_PUBLIC_BEGIN

namespace fsdp {

/// What the library sent through the process group since wrapping (what wrapping itself sent, the
/// cross-rank model check and the broadcast of rank 0's weights, is not counted) or the last reset.
/// A collective over a one-rank group moves nothing and is still counted, so that the counts are
/// the algorithm's at every world size. `elements` is the ZeRO
/// paper's communication volume: all-gather output + reduce-scatter input + 2 x all-reduce elements.
/// The small cross-rank checks (at each forward, backward and clipping call) are counted apart.
struct CommStats {
  /// Collectives issued, by kind.
  int64_t all_gathers = 0, reduce_scatters = 0, all_reduces = 0, broadcasts = 0;
  int64_t elements = 0;  ///< the ZeRO paper's volume (above)
  int64_t checks = 0;    ///< cross-rank agreements
  /// Bytes sent across replicas: the collectives over hybrid sharding's replicate groups (the
  /// gradients' all-reduce of every step; fsdp::optim::LocalSGD's and DiLoCo's outer steps and
  /// their first broadcast), counted as `elements` is (twice each all-reduce) but in bytes of the
  /// tensors' dtype. Part of the counts above, not in addition to them.
  int64_t replica_bytes = 0;
  /// Point-to-point transfers (fsdp::pp's activations forward and their gradients backward), apart
  /// from the collectives above: sends and receives issued, and the bytes of their tensors, sent
  /// plus received (each transfer's small shape header not included).
  int64_t sends = 0, recvs = 0;
  int64_t p2p_bytes = 0;
};

/// The library's temporary buffers (FSDPModule::buffer_cache_stats): a unit's all-gather output,
/// its unsharded storage while gathered and its packed gradients are taken from a cache and given
/// back to it, so that a step reuses the memory of the step before instead of allocating it again.
/// On CUDA the caching allocator does this and nothing is kept here.
struct BufferCacheStats {
  int64_t cached_bytes = 0;  ///< kept now, not in use: beyond FSDPModule::held_state_bytes()
  /// The most kept at once: 2 x (FullyShardOptions::prefetch + 2) buffers of the largest unit's
  /// unsharded size (the buffers of the units that can be in flight together: the root, the unit
  /// computing, those prefetched). 0 where nothing is sharded over more than one rank.
  int64_t cap_bytes = 0;
  int64_t reused = 0;     ///< buffers taken from the cache since wrapping
  int64_t allocated = 0;  ///< buffers allocated because none of their size was kept
};

}  // namespace fsdp

FSDP_PUBLIC_END
