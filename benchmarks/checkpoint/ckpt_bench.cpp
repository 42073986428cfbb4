// ckpt_bench: sharded checkpoints against plain large writes and reads of the same bytes and
// against PyTorch DCP, and the manifest's cost at many simulated ranks (docs/benchmarks.md,
// "Checkpoints"). This file: the flags, the mode, the exit status; each mode is its own file
// (ckpt_modes.h).
//
//   torchrun --no-python --nproc-per-node 4 build/benchmarks/ckpt_bench save --dir D
//   torchrun --no-python --nproc-per-node 3 build/benchmarks/ckpt_bench load --dir D
//   build/benchmarks/ckpt_bench simulate --ranks 128,256,512,1024
//   build/benchmarks/ckpt_bench compare --json
#include "benchmarks/checkpoint/ckpt_flags.h"
#include "benchmarks/checkpoint/ckpt_modes.h"
#include "programs/program.h"

int main(int argc, char** argv) {
  return fsdp::programs::Program("ckpt_bench").main([&] {
    const ckpt::Flags f = ckpt::parse_flags(argc, argv);
    if (f.mode == "simulate") return ckpt::simulate_mode(f);
    if (f.mode == "compare") return ckpt::compare_mode(f);
    at::set_num_threads(1);
    ckpt::Job j;
    j.pg = fsdp::init_process_group();
    j.rank = j.pg->getRank();
    j.world = j.pg->getSize();
    return f.mode == "save" ? ckpt::save_mode(f, j) : f.mode == "load" ? ckpt::load_mode(f, j) : ckpt::async_mode(f, j);
  });
}
