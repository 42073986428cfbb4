#include "checkpoint/internal/stage_states.h"

#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"

#include <algorithm>

namespace fsdp::checkpoint::detail {

std::vector<StageState> checked_stages(const std::vector<StageState>& stages, const char* call) {
  FSDP_CHECK(!stages.empty(), "this rank gave no stages: give each rank the pipeline stages it holds.");
  std::vector<StageState> sorted = stages;
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.index < b.index; });
  for (size_t i = 0; i < sorted.size(); ++i) {
    const StageState& s = sorted[i];
    FSDP_CHECK(s.index >= 0, "a stage's index is ", s.index, ": give each stage its index in the pipeline, from 0.");
    FSDP_CHECK(i == 0 || sorted[i - 1].index != s.index, "stage ", s.index,
               " is given twice on this rank: give each of its stages once.");
    FSDP_CHECK(!s.model.step_in_progress(), "stage ", s.index,
               "'s model is inside a step (a forward ran with gradients and its backward has not): ", call,
               " between steps, after the optimizer's step and before the next forward.");
    FSDP_CHECK(!fsdp::detail::replicas_apart(s.model), "stage ", s.index,
               "'s replicas train apart (fsdp::optim::LocalSGD or DiLoCo), which a pipelined checkpoint does not "
               "hold: train the stages synchronously.");
  }
  return sorted;
}

}  // namespace fsdp::checkpoint::detail
