// A process group that communicates nothing but keeps every shape: one rank of a job of any size,
// in one process. Wrapping a model over it gives exactly the shards, buffers and collective
// counts that rank would have, so per-rank memory at 1024 ranks can be measured on one machine
// (benchmarks' simulated scale). The numbers it trains to are not a real job's: an all-gather
// tiles this rank's shard, a reduce-scatter keeps this rank's own contribution, an all-reduce and
// a broadcast leave the tensor as it is.
#pragma once

#include "fsdp/export.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

FSDP_PUBLIC_BEGIN

namespace fsdp {

/// Rank `rank` of `world_size` over the fake backend, for CPU and CUDA tensors (a CUDA model's
/// copies run on the streams the library issues them on, as NCCL's would).
c10::intrusive_ptr<c10d::ProcessGroup> make_fake_process_group(int rank, int world_size);

}  // namespace fsdp

FSDP_PUBLIC_END
