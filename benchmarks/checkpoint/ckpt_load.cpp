// ckpt_bench load: --dir's latest checkpoint loaded on this many ranks, alternating with each rank
// reading as many bytes as the load read from the raw files of ckpt_bench save, in 8 MiB preads
// (ckpt_raw_io.h); before each, every file under --dir is dropped from the page cache, so both read
// the disk. Each repetition also loads with LoadOptions::in_place (straight into the shards). Bytes
// read over bytes needed over all ranks. One JSON line per repetition from rank 0.
#include "benchmarks/checkpoint/ckpt_modes.h"
#include "benchmarks/checkpoint/ckpt_raw_io.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/commit.h"

#include <unistd.h>

namespace ckpt {

int load_mode(const Flags& f, const Job& j) {
  State s = build(f, j, 2);
  int saved_ranks = 0;
  while (::access(raw_file(f.dir, saved_ranks).c_str(), F_OK) == 0) ++saved_ranks;
  const std::string ckpt = fsdp::checkpoint::latest_checkpoint(f.dir);
  TORCH_CHECK(!ckpt.empty(), "no checkpoint under ", f.dir, ": run ckpt_bench save first");
  fsdp::checkpoint::LoadResult res;  // the last load's (the first tells the raw read its bytes)
  for (int rep = 0; rep < f.reps; ++rep) {
    double load_s = 0, in_place_s = 0, raw_s = 0;
    auto load = [&] {
      if (j.rank == 0) drop_cache(f.dir);
      load_s = timed(j.pg, [&] {
        res = fsdp::checkpoint::load(ckpt, s.model, *s.opt, fsdp::checkpoint::LoadOptions().io_threads(f.io_threads));
      });
    };
    auto in_place = [&] {
      if (j.rank == 0) drop_cache(f.dir);
      in_place_s = timed(j.pg, [&] {
        fsdp::checkpoint::load(ckpt, s.model, *s.opt,
                               fsdp::checkpoint::LoadOptions().io_threads(f.io_threads).in_place(true));
      });
    };
    auto raw = [&] {
      if (j.rank == 0) drop_cache(f.dir);
      auto mine = torch::zeros({j.world}, torch::kLong);
      mine[j.rank] = res.bytes_read;
      fsdp::all_reduce(j.pg, mine);
      const int64_t offset = j.rank == 0 ? 0 : mine.narrow(0, 0, j.rank).sum().item<int64_t>();
      std::vector<char> dst(static_cast<size_t>(res.bytes_read), 0);  // touched before the clock
      raw_s = timed(j.pg, [&] { raw_read(f.dir, saved_ranks, offset, res.bytes_read, dst, f.io_threads); });
    };
    if (rep % 2 == 0) {  // the first load tells how many bytes the raw read is to match
      load();
      in_place();
      raw();
    } else {
      raw();
      in_place();
      load();
    }
    if (j.rank != 0) continue;
    const double read = static_cast<double>(res.bytes_read_total);
    fsdp::programs::print_row({{"mode", "load"},
                               {"rep", rep},
                               {"ranks", j.world},
                               {"saved_by", res.saved_world_size},
                               {"io_threads", f.io_threads},
                               {"order", rep % 2 == 0 ? "load first" : "raw first"},
                               {"bytes_needed_total", res.bytes_needed_total},
                               {"bytes_read_total", res.bytes_read_total},
                               {"read_over_needed", round_to(read / static_cast<double>(res.bytes_needed_total), 4)},
                               {"manifest_bytes", res.manifest_bytes},
                               {"preads_rank0", res.preads},
                               {"files_rank0", res.files_opened},
                               {"load_s", round_to(load_s, 4)},
                               {"raw_read_s", round_to(raw_s, 4)},
                               {"load_over_raw", round_to(load_s / raw_s, 3)},
                               {"load_in_place_s", round_to(in_place_s, 4)},
                               {"load_in_place_over_raw", round_to(in_place_s / raw_s, 3)},
                               {"load_MBps", round_to(read / load_s / 1e6, 1)},
                               {"raw_MBps", round_to(read / raw_s / 1e6, 1)}});
  }
  return 0;
}

}  // namespace ckpt
