// A vocabulary-parallel cross-entropy (Megatron-LM's vocab_parallel_cross_entropy): the loss of
// logits whose vocabulary is split over the T ranks of a tensor-parallel group, without the full
// logits on any rank.
//
//   auto logits = head(h);   // ColumnParallelLinear(C, V) without gather_output: [B, S, V / T]
//   auto loss = fsdp::tp::vocab_parallel_cross_entropy(logits, targets, tp);   // = cross_entropy
//
// Each rank computes, per token, the maximum of its logits, the sum of their exponentials and the
// target's logit (zero unless it holds the target), and three all-reduces of [tokens] elements
// (maximum, sum, sum) give the log-softmax of the target: log(sum exp(l - m)) - (l_target - m).
// Backward needs no communication: each rank's gradient is softmax - one-hot on its columns.
#pragma once

#include "fsdp/export.h"
#include "tp/group.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>

FSDP_PUBLIC_BEGIN

namespace fsdp::tp {

struct VocabParallelCrossEntropyOptions {
  /// Targets equal to it contribute nothing and are not counted in the mean (torch's default).
  TORCH_ARG(int64_t, ignore_index) = -100;
};

/// The mean over the targets not ignored of -log softmax(logits)[target], as
/// torch::nn::functional::cross_entropy of the full logits. `local_logits`: [..., V / T], this
/// rank's columns [r V/T, (r + 1) V/T) of the vocabulary; `targets`: [...] integers in [0, V).
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets, const Group& group,
                                        const VocabParallelCrossEntropyOptions& options = {});

}  // namespace fsdp::tp

FSDP_PUBLIC_END
