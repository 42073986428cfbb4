// Ranks end with their launcher. Internal to the library.
#pragma once

#include "fsdp/process_group.h"

namespace fsdp::detail {

/// When torchrun started this process (or FSDP_PARENT_DEATH_SIGNAL asks for it), arranges for it
/// to get SIGTERM (or the signal named) when its parent dies, so that a rank never runs on,
/// orphaned, after its launcher was killed (even with SIGKILL, which lets torchrun stop nothing).
/// FSDP_PARENT_DEATH_SIGNAL=0 turns it off. Linux only (prctl PR_SET_PDEATHSIG).
void arm_parent_death_signal(const LaunchEnv& env);

}  // namespace fsdp::detail
