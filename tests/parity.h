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
inline std::unique_ptr<torch::optim::Optimizer> make_sharded_optimizer(Opt o, const detail::RootHandle& model) {
  if (o == Opt::kFusedAdamW) {
    return std::make_unique<fsdp::optim::FusedAdamW>(model, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  }
  return make_optimizer(o, model.sharded_parameters());
}

/// Trains `steps` steps twice: plain LibTorch on the global batch (every rank computes it), and
/// sharded on this rank's rows. `make_ref` / `make_sharded` build the same model from one seed;
/// `batch(step)` returns {input, target} of the global batch; `loss_fn(model_output, target)`.
template <typename Ref, typename Sharded, typename Batch, typename LossFn>
void check_parity(Rank& r, Opt opt, int steps, Ref make_ref, Sharded make_sharded, Batch batch, LossFn loss_fn,
                  FullyShardOptions options = test_options(), double clip = 0, double norm_type = 2.0) {
  torch::manual_seed(0);
  auto ref = make_ref();
  torch::manual_seed(0);
  auto model = fsdp::fully_shard(make_sharded(), r.pg, options);
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
    auto loss = loss_fn(model(local_rows(x, r.rank, r.world_size)), local_rows(y, r.rank, r.world_size));
    loss.backward();
    if (clip > 0) {
      const double norm = fsdp::optim::clip_grad_norm(model, clip, norm_type);
      EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm) << "global gradient norm at step " << step;
      EXPECT_GT(ref_norm, clip) << "the test should clip";
    }
    opt_sharded->step();
    if (auto* fused = dynamic_cast<fsdp::optim::FusedAdamW*>(opt_sharded.get())) {
      // Every unit with a flat shard is updated as one tensor (kShardOptimizerState's shards are
      // slices of the full parameters: one tensor per parameter).
      size_t units = 0;
      bool flat = true;
      for (const auto& u : model.units()) {
        units += u.shard_numel > 0;
        flat = flat && u.strategy != ShardingStrategy::kShardOptimizerState;
      }
      if (flat) EXPECT_EQ(fused->tensors_last_step(), units) << "every unit updated as one flat tensor";
    }

    // The global loss is the mean of the ranks' local means (equal shares).
    auto global = loss.detach().clone();
    all_reduce_sum(r, global);
    global.div_(r.world_size);
    EXPECT_TRUE(close(global, ref_loss.detach())) << "loss at step " << step;
  }

  expect_shards_match(r, model, *ref);
}

/// check_parity for the GPT on random tokens: global batch `step -> seed_base + step`.
inline void check_gpt_parity(Rank& r, Opt opt, int steps, const gpt::Config& cfg, int seed_base,
                             FullyShardOptions options = test_options()) {
  auto batch = [&](int step) {
    torch::manual_seed(seed_base + step);
    auto tok = torch::randint(cfg.vocab_size, {kGlobalBatch, cfg.block_size + 1}, torch::kLong);
    return std::make_pair(tok.narrow(1, 0, cfg.block_size), tok.narrow(1, 1, cfg.block_size));
  };
  check_parity(
      r, opt, steps, [&] { return gpt::make_gpt<false>(cfg); }, [&] { return gpt::make_gpt<true>(cfg); }, batch,
      [](const torch::Tensor& logits, const torch::Tensor& y) {
        return torch::nn::functional::cross_entropy(logits.flatten(0, 1), y.flatten());
      },
      options);
}

}  // namespace fsdp::testing
