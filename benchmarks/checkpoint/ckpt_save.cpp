// ckpt_bench save: a GPT with AdamW (one step taken, so the moments exist) saved to --dir,
// alternating with each rank writing the same number of bytes to its own file in 8 MiB blocks and
// fsyncing it (ckpt_raw_io.h); the time of each, barrier to barrier, and their ratio; each rank's
// bytes (max/mean). One JSON line per repetition from rank 0.
#include "benchmarks/checkpoint/ckpt_modes.h"
#include "benchmarks/checkpoint/ckpt_raw_io.h"
#include "checkpoint/checkpoint.h"

#include <sys/stat.h>

#include <sstream>

namespace ckpt {

int save_mode(const Flags& f, const Job& j) {
  State s = build(f, j, 1);
  ::mkdir(f.dir.c_str(), 0755);
  ::mkdir((f.dir + "/raw").c_str(), 0755);
  int64_t mine = 0;  // this rank's bytes in the last save (the first save runs before any raw write)
  for (int rep = 0; rep < f.reps; ++rep) {
    fsdp::checkpoint::SaveResult res;
    double save_s = 0, raw_s = 0;
    auto save = [&] {
      save_s = timed(j.pg, [&] {
        res = fsdp::checkpoint::save(f.dir, s.model, *s.opt,
                                     fsdp::checkpoint::SaveOptions()
                                         .name("rep-" + std::to_string(rep))
                                         .step(rep)
                                         .keep_last(1)
                                         .io_threads(f.io_threads)
                                         .direct_io(f.direct));
      });
      mine = res.bytes_written;
    };
    auto raw = [&] {
      const std::vector<char> src(static_cast<size_t>(mine), 'x');  // in memory (touched) before the clock
      raw_s = timed(j.pg, [&] { raw_write(raw_file(f.dir, j.rank), src, f.io_threads, f.direct); });
    };
    if (rep % 2 == 0) {
      save();
      raw();
    } else {
      raw();
      save();
    }
    auto per_rank = torch::zeros({j.world}, torch::kLong);
    per_rank[j.rank] = res.bytes_written;
    fsdp::all_reduce(j.pg, per_rank);
    if (j.rank != 0) continue;
    const double total = static_cast<double>(per_rank.sum().item<int64_t>());
    const double mx = static_cast<double>(per_rank.max().item<int64_t>());
    std::ostringstream bytes;  // "b0/b1/..."
    for (int r = 0; r < j.world; ++r) bytes << (r ? "/" : "") << per_rank[r].item<int64_t>();
    fsdp::programs::print_row({{"mode", "save"},
                               {"rep", rep},
                               {"ranks", j.world},
                               {"strategy", f.strategy},
                               {"io_threads", f.io_threads},
                               {"direct", f.direct},
                               {"order", rep % 2 == 0 ? "save first" : "raw first"},
                               {"bytes_total", res.bytes_total},
                               {"save_s", round_to(save_s, 4)},
                               {"raw_write_s", round_to(raw_s, 4)},
                               {"save_over_raw", round_to(save_s / raw_s, 3)},
                               {"save_MBps", round_to(total / save_s / 1e6, 1)},
                               {"raw_MBps", round_to(total / raw_s / 1e6, 1)},
                               {"per_rank_bytes_max_over_mean", round_to(mx / (total / j.world), 4)},
                               {"per_rank_bytes", bytes.str()}});
  }
  return 0;
}

}  // namespace ckpt
