// Gradient clipping over sharded gradients: the norm is global (every rank's shards), the same on
// every rank, and equal to torch::nn::utils::clip_grad_norm_ on the unsharded model.
#pragma once

#include "fsdp/export.h"
#include "fsdp/fully_shard.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::optim {

/// Scales every sharded gradient of `model` by min(1, max_norm / (total_norm + 1e-6)) and returns
/// total_norm, the `norm_type` norm of all gradients of the full model (inf: the largest absolute
/// value). Call after backward() and before the optimizer step, on every rank. One all-reduce.
///
/// With `error_if_nonfinite` (as PyTorch's clip_grad_norm_), a total norm that is NaN or infinite
/// throws a c10::Error on every rank alike (they all see the same reduced norm), before anything is
/// scaled, naming the norm and this rank's first parameter whose gradient is not finite. Without
/// it, a non-finite norm is returned: NaN scales nothing, infinity zeroes the gradients.
double clip_grad_norm(const FSDPModule& model, double max_norm, double norm_type = 2.0,
                      bool error_if_nonfinite = false);

/// Pipeline stages (fsdp::pp): the norm of the gradients of `models` (this rank's stages, each
/// wrapped over its own stage's ranks, pp::stage_mesh) and of the other pipeline ranks' stages,
/// summed over `pipeline` (the mesh's pp group): the whole model's norm, the same on every rank;
/// every gradient then scaled as above. A parameter named in `skip` (its name in its model) is
/// scaled but left out of the norm: a tied head's copy of the embedding, which the first stage
/// counts. The gradients as this call finds them count as the pipeline's own (a tied weight's
/// copies summed in place before it, on the first and the last stage), not as a per-rank rescale
/// for FSDP's check to warn about. Every rank calls it; one all-reduce per model over its ranks,
/// then one over `pipeline`.
double clip_grad_norm(const std::vector<FSDPModule>& models, const c10::intrusive_ptr<c10d::ProcessGroup>& pipeline,
                      double max_norm, const std::vector<std::string>& skip = {}, double norm_type = 2.0,
                      bool error_if_nonfinite = false);

/// The same global norm as clip_grad_norm, gradients left as they are (for logging, or to detect
/// a diverging run without clipping). One all-reduce; call it on every rank.
double grad_norm(const FSDPModule& model, double norm_type = 2.0, bool error_if_nonfinite = false);

}  // namespace fsdp::optim

FSDP_PUBLIC_END
