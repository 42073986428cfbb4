// This rank's stages of a pipelined checkpoint (checkpoint/pipelined.h), checked before a save or a
// load uses them. Internal to the checkpoint library.
#pragma once

#include "checkpoint/pipelined.h"

#include <vector>

namespace fsdp::checkpoint::detail {

/// `stages` in stage order, refused (naming the stage) when there is none, an index is negative or
/// given twice, a model is inside a step, or its replicas train apart (LocalSGD, DiLoCo). `call`
/// ("save", "load") names what must wait for the step's end.
std::vector<StageState> checked_stages(const std::vector<StageState>& stages, const char* call);

}  // namespace fsdp::checkpoint::detail
