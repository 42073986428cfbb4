// The environment variables libtorch-fsdp reads, in one place. Each is optional; a value that
// cannot be parsed is an error naming the variable (never silently ignored).
//
//   FSDP_TIMEOUT                 seconds (decimal, fractions allowed, at most a year): the default bound
//                                on start-up and on every collective, used where InitOptions::timeout /
//                                FullyShardOptions::timeout is not set explicitly. Unset (or empty):
//                                10 minutes (c10d's and NCCL's default).
//   FSDP_JOB_ID                  this job's identity, checked at start-up; else TORCHELASTIC_RUN_ID
//                                (torchrun), else SLURM_JOB_ID[.SLURM_STEP_ID] (srun), else none.
//   FSDP_PARENT_DEATH_SIGNAL     TERM (default when torchrun started this process), KILL, or 0 (off):
//                                the signal this process gets when its launcher dies.
//   FSDP_VERIFY_COLLECTIVES      1: check before every collective that all ranks issue the same one
//                                (see FullyShardOptions::verify_collectives). Unset or 0: off.
//   FSDP_FLIGHT_RECORDER_SIZE    the flight recorder's ring: the last N collectives kept, a whole
//                                number from 0 (off) to 1000000; unset: 256. Written to a file per
//                                rank when a collective times out or fails (docs/usage.md, "When a
//                                run hangs: the flight recorder"; read with fsdp-trace).
//   FSDP_FLIGHT_RECORDER_DIR     the directory of those files; unset: /tmp/fsdp-trace.
//   FSDP_DUMP_ON_SIGNAL          USR1, USR2 (SIG prefix allowed), a real-time signal's number, or 0:
//                                receiving it writes the flight recorder's file; the process goes on.
//   FSDP_RACE_DELAY              a seed (a whole number; unset or 0: off): seeded delays on both sides
//                                of every collective, so that a missing wait shows as different
//                                numbers; results stay bit-identical (docs/usage.md, "Races made
//                                visible"). Each rank prints "race delays applied: N" at exit.
//   FSDP_TEST_GLOO_CUDA          1: a testing mode, never for training: every local rank on cuda:0,
//                                Gloo serving CUDA tensors instead of NCCL (docs/usage.md, "Several
//                                ranks on one GPU"). Unset or 0: off.
#pragma once

#include "fsdp/export.h"

#include <chrono>
#include <string>

FSDP_PUBLIC_BEGIN

namespace fsdp {

/// The timeout used where none was given explicitly: $FSDP_TIMEOUT seconds, else 10 minutes.
std::chrono::milliseconds default_timeout();

/// Whether $FSDP_VERIFY_COLLECTIVES asks for a check before every collective.
bool verify_collectives_from_env();

}  // namespace fsdp

FSDP_PUBLIC_END
