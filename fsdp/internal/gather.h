// Gathering a unit, as functions of its slots and buffers (the collective itself is the caller's,
// through its Comm): what goes into the all-gather and where its output goes.
//
// The all-gather output is rank-major [W, shard_numel]: rank r's flat shard, every parameter's c
// rows at its offset. The unsharded buffer is parameter-major: each parameter's W * c rows
// contiguous, so the gathered parameter is one slice and its padding sits at its end.
#pragma once

#include "fsdp/internal/comm.h"
#include "fsdp/internal/unit_buffers.h"

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace fsdp::detail {

/// ZeRO-1's all-gather input: this rank's rows of every parameter (rows of the full parameters),
/// packed into `in` ([shard_numel]) in the flat layout, padding zeroed.
void pack_rows(const std::vector<ParamSlot>& slots, const at::Tensor& in);

/// Copies the all-gather's output into the unsharded buffer in one pass, below autograd (the
/// copies must not bump version counters of tensors autograd saved).
void copy_out(const at::Tensor& gathered, const at::Tensor& unsharded, const std::vector<ParamSlot>& slots, int64_t W,
              int64_t shard_numel);

/// Each parameter's full value, gathered from the shards over `comm` (S ranks; `rows_of_full`:
/// ZeRO-1's buffers), appended to `out` as a new tensor on `device`. One all-gather, `what` in
/// errors; none when S is 1 or the unit has no elements.
void gather_full(const std::vector<ParamSlot>& slots, const UnitBuffers& buffers, bool rows_of_full, int64_t S,
                 Comm& comm, const std::string& what, const at::Device& device, std::vector<at::Tensor>& out);

}  // namespace fsdp::detail
