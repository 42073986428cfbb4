// Gradient clipping over sharded gradients: the norm is global (every rank's shards), the same on
// every rank, and equal to torch::nn::utils::clip_grad_norm_ on the unsharded model.
#pragma once

#include "fsdp/fully_shard.h"

namespace fsdp::optim {

/// Scales every sharded gradient of `model` by min(1, max_norm / (total_norm + 1e-6)) and returns
/// total_norm, the `norm_type` norm of all gradients of the full model (inf: the largest absolute
/// value). Call after backward() and before the optimizer step, on every rank.
double clip_grad_norm(const detail::RootHandle& model, double max_norm, double norm_type = 2.0);

}  // namespace fsdp::optim
