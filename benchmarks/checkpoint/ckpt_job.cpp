// The pieces of ckpt_bench's modes that are the same in each (ckpt_job.h): the model they save,
// the collectives that time them, and how a result line is printed.
#include "benchmarks/checkpoint/ckpt_job.h"

#include "examples/strategy_flags.h"

#include <torch/nn/functional/loss.h>

#include <algorithm>
#include <cmath>

namespace ckpt {

State build(const Flags& f, const Job& j, uint64_t seed) {
  torch::manual_seed(seed);
  auto model = fsdp::fully_shard(
      gpt::make_gpt<true>(f.model), j.pg,
      fsdp::FullyShardOptions().strategy(gpt::strategy_flags().at(f.strategy)).shard_group_size(std::min(2, j.world)));
  auto opt = std::make_unique<torch::optim::AdamW>(model.parameters(), torch::optim::AdamWOptions(1e-3));
  auto x = torch::randint(256, {j.world, f.model.block_size}, torch::kLong);
  auto logits = model(x.narrow(0, j.rank, 1));
  torch::nn::functional::cross_entropy(logits.flatten(0, 1), x.narrow(0, j.rank, 1).flatten()).backward();
  opt->step();
  return State{std::move(model), std::move(opt)};
}

void barrier(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  auto t = torch::zeros({1});
  fsdp::all_reduce(pg, t);
}

double max_over_ranks(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, double v) {
  auto t = torch::tensor({v}, torch::kDouble);
  fsdp::all_reduce(pg, t, c10d::ReduceOp::MAX);
  return t.item<double>();
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double round_to(double v, int digits) {
  if (!std::isfinite(v)) return v;
  const double scale = std::pow(10.0, digits);
  return std::round(v * scale) / scale;
}

}  // namespace ckpt
