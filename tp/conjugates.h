// The communication of tensor parallelism, as Megatron-LM writes it: each a pair of conjugate
// operations, one in forward and its transpose in backward, as a tiny autograd function. The
// layers of fsdp::tp apply them; a model applies them itself where one input feeds several
// layers (attention's q, k and v projections read one input: copy_to_region once, then layers
// with ColumnParallelLinearOptions::conjugate_input(false), so that backward all-reduces their
// summed gradient once instead of once per layer).
//
// Each collective goes through the group's bounded, counted and recorded path (tp/group.h).
// Shapes: `x` is [..., features] for the feature regions (the last dimension is split over the
// group's T ranks) and [batch, sequence, ...] for the sequence regions (dimension `dim`, 1 by
// default, is split); a split dimension must be divisible by T.
#pragma once

#include "fsdp/export.h"
#include "tp/group.h"

#include <ATen/core/Tensor.h>

#include <cstdint>

FSDP_PUBLIC_BEGIN

namespace fsdp::tp {

/// Megatron's f, before a column-parallel layer: identity forward; backward all-reduces the
/// gradient (each rank computed the part its columns contribute).
at::Tensor copy_to_region(const at::Tensor& x, const Group& group);
/// Megatron's g, after a row-parallel layer: all-reduce forward (the partial products of the
/// rank's input columns); identity backward.
at::Tensor reduce_from_region(const at::Tensor& x, const Group& group);
/// All-gather along the last dimension forward ([..., n] -> [..., T n], rank r's part at columns
/// [r n, (r + 1) n)); backward keeps this rank's columns of the gradient.
at::Tensor gather_from_region(const at::Tensor& x, const Group& group);
/// This rank's columns of the last dimension forward; all-gather of the gradient backward.
at::Tensor scatter_to_region(const at::Tensor& x, const Group& group);

/// Sequence parallelism (Korthikanti et al.; Megatron's sequence_parallel), where activations
/// between tensor-parallel layers are split along the sequence instead of replicated:
/// all-gather along `dim` forward, reduce-scatter of the gradient backward (before a
/// column-parallel layer: replaces copy_to_region).
at::Tensor gather_from_sequence_region(const at::Tensor& x, const Group& group, int64_t dim = 1);
/// Reduce-scatter along `dim` forward, all-gather of the gradient backward (after a row-parallel
/// layer: replaces reduce_from_region).
at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& x, const Group& group, int64_t dim = 1);
/// This rank's part of `dim` forward (no communication), all-gather of the gradient backward:
/// enters the sequence-parallel region from a replicated tensor (the embedding's output).
at::Tensor scatter_to_sequence_region(const at::Tensor& x, const Group& group, int64_t dim = 1);

}  // namespace fsdp::tp

FSDP_PUBLIC_END
