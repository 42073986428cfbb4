// fsdp::pp schedules: GPipe, 1F1B, interleaved 1F1B and zero bubble (ZB-H1), each generated as
// one list of actions per pipeline rank (pp/action.h), computation and transfers, as
// torch.distributed.pipelining lowers its schedules. Every list goes through the validator
// (pp/simulate.h) before a step runs; a list written by hand (parse_lists, PyTorch's CSV) too.
//
//   fsdp::pp::StageLayout layout(4);                         // 4 ranks, one stage each
//   auto lists = fsdp::pp::make_schedule(fsdp::pp::ScheduleKind::k1F1B, layout, /*microbatches=*/8);
//   std::cout << fsdp::pp::format_lists(lists);              // rank 0: 0F0,0SEND_F0,0F1,...
//
// Per rank r of p, with m microbatches (the compute order; a transfer goes right before the
// computation that needs it and right after the one that produced it, where the neighbouring
// stage is on another rank):
//   - GPipe: every forward, then every backward, in microbatch order. Activations of all m
//     microbatches are held at the peak; bubble (p-1)/(m+p-1) of the step.
//   - 1F1B: p-1-r forwards to fill the pipe, then one forward and one backward in turn, then the
//     remaining backwards. The same bubble, at most p microbatches in flight (on the first stage).
//     Needs m >= p (as PyTorch's Schedule1F1B).
//   - Interleaved 1F1B (Megatron-LM's): v stages per rank, looped; forwards go round the ranks in
//     groups of p microbatches, chunk by chunk, and backwards in the reverse chunk order; warm-up
//     (p-r-1)*2 + (v-1)*p. Bubble about (p-1)/(v m) of the ideal step. Needs m a multiple of p.
//   - Zero bubble (ZB-H1): each backward split into the input gradient (I, which the stage before
//     waits for) and the weight gradient (W, which nobody waits for), W deferred into the time a
//     rank would otherwise wait. The order is list scheduling with equal times (a free rank takes
//     an I it can compute, else a forward while fewer than 2p-1-r microbatches are in flight on
//     it, else a deferred W): the step is then 3m + (p-1) units against 1F1B's 3(m + p - 1), i.e.
//     ZB-H1's bubble (p-1)(F + I - W). A microbatch stays in flight until its W (its graph is kept
//     for it), so rank r holds up to 2p-1-r. One stage per rank; m >= p.
#pragma once

#include "fsdp/export.h"
#include "pp/action.h"
#include "pp/stage_layout.h"

#include <cstdint>
#include <string>

FSDP_PUBLIC_BEGIN

namespace fsdp::pp {

enum class ScheduleKind { kGPipe, k1F1B, kInterleaved1F1B, kZeroBubble };

/// "gpipe", "1f1b", "interleaved", "zero-bubble".
std::string to_string(ScheduleKind kind);
/// The reverse; std::invalid_argument listing the names otherwise.
ScheduleKind parse_schedule(const std::string& name);

/// The action lists of `kind` on `layout` for `microbatches` microbatches. Throws
/// std::invalid_argument, naming the numbers and what to change, for what the schedule cannot run:
/// fewer microbatches than stages (1F1B, zero bubble, interleaved), a count the interleaved
/// schedule cannot divide into rounds of p, several stages per rank for a one-stage schedule, a
/// V-shaped layout for the looped ones.
ActionLists make_schedule(ScheduleKind kind, const StageLayout& layout, int64_t microbatches);

}  // namespace fsdp::pp

FSDP_PUBLIC_END
