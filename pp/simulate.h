// The validator of pipeline schedules: every rank's action list (pp/action.h) simulated together,
// before any step runs, the same way on every rank; and the timeline the lists give with
// per-action times (the step, each rank's bubble, the microbatches in flight at the peak).
//
//   auto lists = fsdp::pp::make_schedule(fsdp::pp::ScheduleKind::k1F1B, layout, 8);
//   fsdp::pp::validate(lists, layout, 8);      // std::invalid_argument naming the first offence
//   auto t = fsdp::pp::simulate(lists, layout, 8, {/*forward=*/1.0, /*input=*/1.0, /*weight=*/1.0});
//   t.bubble;                                  // the largest fraction of the step a rank waited
//
// The model of execution is the runtime's: a rank performs its actions in order; a computation or
// a send runs at once (a send completes later, when its receive is posted); a receive blocks until
// the peer has posted its send. A list is refused, naming the rank, the position and the action:
//   - an action of a stage the rank does not hold, of a microbatch outside [0, m), or repeated;
//   - a send without its receive on the peer's rank, a receive without its send, a transfer
//     between two stages of one rank (they hand over in memory);
//   - a computation before what it needs: a forward before its input (the receive, or the stage
//     before on this rank), a backward before its forward or its output gradient, a weight
//     gradient before its input gradient, a send before what it sends;
//   - an order that deadlocks: every unfinished rank waits on a receive whose send comes later in
//     its peer's list (the message names each waiting rank and what it waits for);
//   - a microbatch some stage never runs forward or backward (B, or I and W).
#pragma once

#include "fsdp/export.h"
#include "pp/action.h"
#include "pp/stage_layout.h"

#include <cstdint>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::pp {

/// The time of each computation of one stage and microbatch (any unit), and of a transfer.
struct ActionCosts {
  double forward = 1.0;
  double backward_input = 1.0;   ///< I; a whole backward (B) costs backward_input + backward_weight
  double backward_weight = 1.0;  ///< W
  double transfer = 0.0;         ///< from a send's post to its data at the receiver
};

struct Timeline {
  double step = 0;                  ///< when the last rank finishes
  std::vector<double> busy;         ///< per rank: time spent computing
  std::vector<double> rank_bubble;  ///< per rank: 1 - busy / step
  double bubble = 0;                ///< the largest rank_bubble
  std::vector<int64_t>
      peak_in_flight;  ///< per rank: the most microbatch-stages whose forward ran and backward (B or W) had not
};

/// Simulates `lists` (one per pipeline rank of `layout`) for `microbatches` microbatches with
/// `costs`; throws std::invalid_argument as above.
Timeline simulate(const ActionLists& lists, const StageLayout& layout, int64_t microbatches,
                  const ActionCosts& costs = {});
/// simulate(), for its refusals only.
void validate(const ActionLists& lists, const StageLayout& layout, int64_t microbatches);

}  // namespace fsdp::pp

FSDP_PUBLIC_END
