// Model-state bytes (parameters, gradients, optimizer state) as this rank holds them: what the
// ZeRO formulas (16 bytes per parameter with fp32 Adam, divided by the ranks when sharded) count.
#pragma once

#include "fsdp/export.h"

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::optim {

struct StateBytes {
  int64_t params = 0;
  int64_t grads = 0;
  int64_t optimizer = 0;
  int64_t total() const { return params + grads + optimizer; }
};

/// Bytes of the storages behind `params`, their .grad and the optimizer's state for them, each
/// storage counted once (a unit's shards share one flat buffer, padding included). Knows the state
/// of torch::optim::SGD, Adam, AdamW (and so fsdp::optim::FusedAdamW), Adagrad and RMSprop; other
/// optimizers' state is not counted.
StateBytes state_bytes(const std::vector<at::Tensor>& params, const torch::optim::Optimizer* optimizer = nullptr);

}  // namespace fsdp::optim

FSDP_PUBLIC_END
