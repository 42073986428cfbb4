// The parity check shared by the parity suites: N ranks of sharded training against plain LibTorch
// on the concatenated batch, every step (losses, optionally the clipped norm) and after training
// (every parameter's shard).
#pragma once

#include "tests/models.h"

#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>

#include <memory>
#include <vector>

namespace fsdp::testing {

enum class Opt { kSGD, kAdamW, kFusedAdamW };

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt o, const std::vector<torch::Tensor>& params) {
  if (o == Opt::kSGD) return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
}

/// The sharded side's optimizer: FusedAdamW works on the model's units, the others on its shards.
inline std::unique_ptr<torch::optim::Optimizer> make_sharded_optimizer(Opt o, const FSDPModule& model) {
  if (o == Opt::kFusedAdamW) {
    return std::make_unique<fsdp::optim::FusedAdamW>(model, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  }
  return make_optimizer(o, model.parameters());
}

/// The example GPT's loss: cross-entropy over every position.
inline torch::Tensor gpt_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.flatten(0, 1), targets.flatten());
}

/// A global batch of random tokens drawn from `seed`: {input, next-token targets}.
inline std::pair<torch::Tensor, torch::Tensor> gpt_batch(const gpt::Config& cfg, int64_t seed,
                                                         int64_t rows = kGlobalBatch) {
  torch::manual_seed(seed);
  auto tok = torch::randint(cfg.vocab_size, {rows, cfg.block_size + 1}, torch::kLong);
  return {tok.narrow(1, 0, cfg.block_size), tok.narrow(1, 1, cfg.block_size)};
}

/// Trains `steps` steps twice: plain LibTorch `ref` on the global batch (every rank computes it),
/// and the wrapped `model` (built from the same seed) on this rank's rows; compares the global
/// loss every step and the shards at the end. `batch(step)` returns {input, target} of the global
/// batch; `loss_fn(model_output, target)`. `after_backward(step)` runs between the sharded
/// backward and its optimizer step, with the model's collective counts of that step.
template <typename Ref, typename Model, typename Batch, typename LossFn, typename AfterBackward>
void train_and_compare(Rank& r, Opt opt, int steps, Ref& ref, Model& model, Batch batch, LossFn loss_fn,
                       AfterBackward after_backward, double clip = 0, double norm_type = 2.0) {
  auto ref_opt = make_optimizer(opt == Opt::kFusedAdamW ? Opt::kAdamW : opt, ref->parameters());
  auto opt_sharded = make_sharded_optimizer(opt, model);

  for (int step = 0; step < steps; ++step) {
    auto [x, y] = batch(step);
    ref_opt->zero_grad();
    auto ref_loss = loss_fn(ref->forward(x), y);
    ref_loss.backward();
    double ref_norm = 0;
    if (clip > 0) ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), clip, norm_type);
    ref_opt->step();

    opt_sharded->zero_grad();
    model.reset_comm_stats();
    auto loss = loss_fn(model(local_rows(x, r.rank, r.world_size)), local_rows(y, r.rank, r.world_size));
    loss.backward();
    after_backward(step);
    if (clip > 0) {
      const double norm = fsdp::optim::clip_grad_norm(model, clip, norm_type);
      EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm) << "global gradient norm at step " << step;
      EXPECT_GT(ref_norm, clip) << "the test should clip";
    }
    opt_sharded->step();
    if (auto* fused = dynamic_cast<fsdp::optim::FusedAdamW*>(opt_sharded.get())) {
      // Every unit with a flat shard is updated as one tensor (kShardOptimizerState's shards are
      // slices of the full parameters: one tensor per parameter). Alone (world size 1) the
      // gradients stay the tensors autograd produced: one tensor per parameter with elements.
      size_t units = 0, params = 0;
      bool flat = true;
      for (const auto& u : model.units()) {
        units += u.shard_numel > 0;
        flat = flat && u.strategy != ShardingStrategy::kShardOptimizerState;
      }
      for (const auto& p : model.parameters()) params += p.numel() > 0 && p.grad().defined();
      if (flat && r.world_size > 1)
        EXPECT_EQ(fused->tensors_last_step(), units) << "every unit updated as one flat tensor";
      if (flat && r.world_size == 1) EXPECT_EQ(fused->tensors_last_step(), params) << "one tensor per parameter";
    }

    // The global loss is the mean of the ranks' local means (equal shares).
    auto global = loss.detach().clone();
    all_reduce_sum(r, global);
    global.div_(r.world_size);
    EXPECT_TRUE(close(global, ref_loss.detach())) << "loss at step " << step;
  }

  expect_shards_match(r, model, *ref);
}

/// The loop of the tests whose step is not one forward of one batch (several forwards, an extra
/// evaluation, a custom loss): `steps` steps of plain LibTorch `ref` with `ref_opt` and of the
/// wrapped `model` with `opt`, the global loss compared every step (the caller compares the
/// shards at the end). `loss(forward, rows, step, wrapped)` computes one step's loss once for
/// both sides: `forward(x)` runs the side's model and `rows(t)` is the side's share of a global
/// tensor (all of it for the reference, this rank's rows for the wrapped model). `between(step)`
/// runs after the wrapped model's backward, before its optimizer step.
template <typename Ref, typename Model, typename LossFn, typename Between>
void compare_steps(Rank& r, Ref& ref, Model& model, torch::optim::Optimizer& ref_opt, torch::optim::Optimizer& opt,
                   int steps, LossFn loss, Between between) {
  auto all = [](const torch::Tensor& t) { return t; };
  auto mine = [&](const torch::Tensor& t) { return local_rows(t, r.rank, r.world_size); };
  for (int step = 0; step < steps; ++step) {
    ref_opt.zero_grad();
    auto ref_loss = loss([&](const torch::Tensor& x) { return ref->forward(x); }, all, step, false);
    ref_loss.backward();
    ref_opt.step();

    opt.zero_grad();
    auto local = loss([&](const torch::Tensor& x) { return model(x); }, mine, step, true);
    local.backward();
    between(step);
    opt.step();
    // The global loss is the mean of the ranks' local means (equal shares).
    auto global = local.detach().clone();
    all_reduce_sum(r, global);
    global.div_(r.world_size);
    EXPECT_TRUE(close(global, ref_loss.detach())) << "loss at step " << step;
  }
}

/// train_and_compare with both models built here from seed 0 (`make_ref` / `make_sharded`), the
/// sharded one wrapped with `options`.
template <typename Ref, typename Sharded, typename Batch, typename LossFn>
void check_parity(Rank& r, Opt opt, int steps, Ref make_ref, Sharded make_sharded, Batch batch, LossFn loss_fn,
                  FullyShardOptions options = test_options(), double clip = 0, double norm_type = 2.0) {
  torch::manual_seed(0);
  auto ref = make_ref();
  torch::manual_seed(0);
  auto model = fsdp::fully_shard(make_sharded(), r.pg, options);
  train_and_compare(
      r, opt, steps, ref, model, batch, loss_fn, [](int) {}, clip, norm_type);
}

/// Gradient accumulation over 3 micro-batches per step, 3 steps, against plain LibTorch with the
/// same total batch: every micro-batch reduces (`sync_every`) or only the last one does.
/// `check_comm(model, sync, micro_batch)` runs after each sharded micro-batch's backward.
inline const gpt::Config kAccumulationConfig{29, 6, 2, 2, 12, true};
template <typename CheckComm>
void check_accumulation(Rank& r, const FullyShardOptions& options, bool sync_every, CheckComm check_comm) {
  const gpt::Config& cfg = kAccumulationConfig;
  constexpr int kMicro = 3;
  torch::manual_seed(0);
  auto ref = gpt::make_gpt<false>(cfg);
  torch::manual_seed(0);
  auto model = fsdp::fully_shard(gpt::make_gpt<true>(cfg), r.pg, options);
  auto ref_opt = make_optimizer(Opt::kSGD, ref->parameters());
  auto opt = make_optimizer(Opt::kSGD, model.parameters());
  for (int step = 0; step < 3; ++step) {
    ref_opt->zero_grad();
    opt->zero_grad();
    for (int m = 0; m < kMicro; ++m) {
      auto [x, y] = gpt_batch(cfg, 5000 + step * kMicro + m);
      (gpt_loss(ref->forward(x), y) / kMicro).backward();
      const bool sync = sync_every || m == kMicro - 1;
      model.set_requires_gradient_sync(sync);
      model.reset_comm_stats();
      (gpt_loss(model(local_rows(x, r.rank, r.world_size)), local_rows(y, r.rank, r.world_size)) / kMicro).backward();
      check_comm(model, sync, m);
    }
    ref_opt->step();
    opt->step();
  }
  expect_shards_match(r, model, *ref);
}

/// check_parity for the GPT on random tokens: global batch `step -> seed_base + step`.
inline void check_gpt_parity(Rank& r, Opt opt, int steps, const gpt::Config& cfg, int seed_base,
                             FullyShardOptions options = test_options()) {
  check_parity(
      r, opt, steps, [&] { return gpt::make_gpt<false>(cfg); }, [&] { return gpt::make_gpt<true>(cfg); },
      [&](int step) { return gpt_batch(cfg, seed_base + step); }, gpt_loss, options);
}

}  // namespace fsdp::testing
