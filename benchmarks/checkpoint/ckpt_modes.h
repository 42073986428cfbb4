// ckpt_bench's five modes, one file each (docs/benchmarks.md, "Checkpoints"): save, load and async
// run as the ranks of a job; simulate in one process; compare starts the others (and PyTorch DCP's
// benchmarks/checkpoint/dcp_bench.py) at each world size. Each returns the exit status.
#pragma once

#include "benchmarks/checkpoint/ckpt_flags.h"
#include "benchmarks/checkpoint/ckpt_job.h"

namespace ckpt {

int save_mode(const Flags& f, const Job& j);   // ckpt_save.cpp
int load_mode(const Flags& f, const Job& j);   // ckpt_load.cpp
int async_mode(const Flags& f, const Job& j);  // ckpt_async.cpp
int simulate_mode(const Flags& f);             // ckpt_simulate.cpp
int compare_mode(const Flags& f);              // ckpt_compare.cpp

}  // namespace ckpt
