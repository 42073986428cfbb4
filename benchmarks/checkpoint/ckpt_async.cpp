// ckpt_bench async: the training stall of AsyncSaver::save (the call's time, max over ranks) against
// a synchronous save of the same state and against a plain memcpy of this rank's bytes (the floor
// on CPU); training steps run while the background write goes on (every rank steps until no rank's
// save is still writing), their time against steps with no save in flight; RSS after each save and
// the peak (VmHWM) over all of them. One JSON line from rank 0.
#include "benchmarks/bench_run.h"
#include "benchmarks/checkpoint/ckpt_modes.h"
#include "checkpoint/async_save.h"
#include "checkpoint/checkpoint.h"

#include <torch/nn/functional/loss.h>

#include <sys/stat.h>

#include <cstring>
#include <iostream>

namespace ckpt {
int async_mode(const Flags& f, const Job& j) {
  State s = build(f, j, 3);
  ::mkdir(f.dir.c_str(), 0755);
  auto step = [&] {
    auto x = torch::randint(256, {1, f.model.block_size}, torch::kLong);
    auto logits = s.model(x);
    torch::nn::functional::cross_entropy(logits.flatten(0, 1), x.flatten()).backward();
    s.opt->step();
    s.opt->zero_grad();
  };
  std::vector<double> plain, sync;
  for (int i = 0; i < 3; ++i) plain.push_back(timed(j.pg, step));
  int64_t mine = 0;
  for (int i = 0; i < 2; ++i) {
    sync.push_back(timed(j.pg, [&] {
      mine = fsdp::checkpoint::save(f.dir, s.model, *s.opt,
                                    fsdp::checkpoint::SaveOptions().name("sync-" + std::to_string(i)).keep_last(1))
                 .bytes_written;
    }));
  }
  std::vector<char> from(static_cast<size_t>(mine), 'x'), to(static_cast<size_t>(mine), 'y');
  const auto c0 = Clock::now();
  std::memcpy(to.data(), from.data(), from.size());
  const double copy_s = max_over_ranks(j.pg, seconds_since(c0));
  fsdp::checkpoint::AsyncSaver saver(s.model);
  std::vector<double> stalls, totals, during;
  std::vector<int64_t> rss;
  for (int rep = 0; rep < f.async_reps; ++rep) {
    barrier(j.pg);
    const auto t0 = Clock::now();
    const auto started = saver.save(
        f.dir, *s.opt, fsdp::checkpoint::SaveOptions().name("async-" + std::to_string(rep)).step(rep).keep_last(1));
    stalls.push_back(max_over_ranks(j.pg, started.seconds));
    for (;;) {
      auto busy = torch::full({1}, saver.writing() ? 1.0 : 0.0);
      fsdp::all_reduce(j.pg, busy, c10d::ReduceOp::MAX);
      if (busy.item<double>() == 0) break;
      const auto s0 = Clock::now();
      step();
      during.push_back(seconds_since(s0));
    }
    saver.wait();
    totals.push_back(max_over_ranks(j.pg, seconds_since(t0)));
    rss.push_back(bench::rss_bytes());
    if (j.rank == 0) std::cerr << "ckpt_bench async: save " << rep + 1 << " of " << f.async_reps << std::endl;
  }
  const double peak = max_over_ranks(j.pg, static_cast<double>(bench::peak_rss_bytes()));
  auto total_bytes = torch::tensor({mine}, torch::kLong);
  fsdp::all_reduce(j.pg, total_bytes);
  double during_mean = 0;
  for (double d : during) during_mean += d / static_cast<double>(during.size());
  if (j.rank != 0) return 0;
  ordered_json stall_list = ordered_json::array();
  for (double x : stalls) stall_list.push_back(round_to(x, 4));
  const double stall = median(stalls);
  fsdp::programs::print_row({{"mode", "async"},
                             {"ranks", j.world},
                             {"bytes_total", total_bytes.item<int64_t>()},
                             {"sync_save_s", round_to(median(sync), 4)},
                             {"async_stall_s", stall_list},
                             {"async_stall_s_median", round_to(stall, 4)},
                             {"async_total_s_median", round_to(median(totals), 4)},
                             {"memcpy_s", round_to(copy_s, 4)},
                             {"stall_over_sync_save", round_to(stall / median(sync), 4)},
                             {"stall_over_memcpy", round_to(stall / copy_s, 3)},
                             {"step_s_plain", round_to(median(plain), 4)},
                             {"step_s_during_async", round_to(during_mean, 4)},
                             {"steps_during_async", during.size()},
                             {"rss_after_each_async", rss},
                             {"host_peak_bytes", static_cast<int64_t>(peak)},
                             {"snapshot_bytes", saver.snapshot_capacity()}});
  return 0;
}

}  // namespace ckpt
