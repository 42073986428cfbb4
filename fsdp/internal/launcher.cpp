#include "fsdp/internal/launcher.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/env.h"

#include "fsdp/env.h"

#include <c10/util/Exception.h>

#include <csignal>
#include <cstdlib>
#include <string>

#ifdef __linux__
#include <sys/prctl.h>
#include <unistd.h>
#endif

namespace fsdp::detail {

void arm_parent_death_signal(const LaunchEnv& env) {
  const char* v = getenv_or_null("FSDP_PARENT_DEATH_SIGNAL");
  const std::string setting = v != nullptr ? v : "";
  int sig = 0;
  if (setting.empty()) {
    // torchrun's workers are its direct children (TORCHELASTIC_RUN_ID is its environment). Under
    // Slurm, slurmstepd already ends a step's tasks when srun dies.
    if (env.launcher == "torchrun" && getenv_or_null("TORCHELASTIC_RUN_ID") != nullptr) sig = SIGTERM;
  } else if (setting == "TERM" || setting == "SIGTERM") {
    sig = SIGTERM;
  } else if (setting == "KILL" || setting == "SIGKILL") {
    sig = SIGKILL;
  } else {
    FSDP_CHECK(setting == "0", "fsdp::init_process_group: FSDP_PARENT_DEATH_SIGNAL='", setting,
               "' must be TERM, KILL or 0 (off).");
  }
  if (sig == 0) return;
#ifdef __linux__
  // The signal comes when the thread that started this process exits: torchrun starts its workers
  // from its main thread, so that is when torchrun exits.
  FSDP_CHECK(prctl(PR_SET_PDEATHSIG, sig) == 0, "fsdp::init_process_group: prctl(PR_SET_PDEATHSIG) failed");
  // The launcher may have died before the call: then this process was already re-parented.
  if (getppid() == 1) std::raise(sig);
#endif
}

}  // namespace fsdp::detail
