// Random number generator states in a checkpoint: each rank saves its own (the CPU generator's,
// and each CUDA device's where CUDA is present) as byte tensors "rng/rank-NNNNN/cpu" and
// "rng/rank-NNNNN/cuda:I", written by that rank alone. A load on M ranks gives rank r the states
// rank r saved; a rank the saving job did not have derives its own deterministically, from a
// checksum of what rank 0 saved and its rank, so that a resumed job draws the same numbers every
// time it is resumed the same way. Internal to the checkpoint library.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::checkpoint::detail {

/// The key prefix of `rank`'s generator states ("rng/rank-00003/").
std::string rng_prefix(int rank);

/// This process's generator states, by name ("cpu", "cuda:0", ...), as CPU byte tensors.
std::vector<std::pair<std::string, at::Tensor>> rng_states();

/// Sets the generator `name` ("cpu", "cuda:I") to `state`. A CUDA device this process does not
/// have is skipped (a job resumed on fewer GPUs per process); returns whether it was set.
bool set_rng_state(const std::string& name, const at::Tensor& state);

/// Seeds this process's generators for a rank that did not exist when the checkpoint was saved:
/// from `base` (a checksum of rank 0's saved state) and `rank`, each device its own seed.
void derive_rng_states(uint32_t base, int rank);

}  // namespace fsdp::checkpoint::detail
