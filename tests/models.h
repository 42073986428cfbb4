// Models and helpers shared by the tests.
#pragma once

#include "examples/gpt.h"
#include "fsdp/fsdp.h"
#include "tests/harness.h"

#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <cstdlib>
#include <map>

namespace fsdp::testing {

/// An MLP with uneven shapes, so that at 2-4 ranks some ranks own fewer rows (or none) of a
/// parameter: 13 and 5 rows are not divisible by 2, 3 or 4; the head has 3 rows; a scalar too.
template <bool kSharded>
struct UnevenMLPImpl : torch::nn::Module {
  template <typename M>
  using Unit = std::conditional_t<kSharded, fsdp::Sharded<typename M::Impl>, M>;

  UnevenMLPImpl()
      : fc1(register_module("fc1", Unit<torch::nn::Linear>(7, 13))),
        fc2(register_module("fc2", Unit<torch::nn::Linear>(13, 5))),
        head(register_module("head", torch::nn::Linear(5, 3))),
        scale(register_parameter("scale", torch::ones({}))) {}

  torch::Tensor forward(const torch::Tensor& x) { return head(torch::tanh(fc2(torch::tanh(fc1(x))))) * scale; }

  Unit<torch::nn::Linear> fc1, fc2;
  torch::nn::Linear head;
  torch::Tensor scale;
};

constexpr int64_t kGlobalBatch = 12;  // divisible by 1, 2, 3 and 4

/// Rows [rank * B/W, (rank + 1) * B/W) of a global batch: this rank's share.
inline torch::Tensor local_rows(const torch::Tensor& global, int rank, int world_size) {
  const int64_t n = global.size(0) / world_size;
  return global.narrow(0, rank * n, n);
}

/// max|a - b| <= rtol * max|b| (the parity tolerance: reduction order alone).
inline ::testing::AssertionResult close(const torch::Tensor& a, const torch::Tensor& b, double rtol = 1e-5) {
  if (a.sizes() != b.sizes()) {
    return ::testing::AssertionFailure() << "shape " << a.sizes() << " vs reference " << b.sizes();
  }
  if (a.numel() == 0) return ::testing::AssertionSuccess();
  const double diff = (a - b).abs().max().item<double>();
  const double ref = b.abs().max().item<double>();
  if (diff <= rtol * ref) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max|diff| " << diff << " > " << rtol << " * max|ref| " << ref;
}

/// The reference rows this rank owns of a full parameter (dim-0 sharding, c = ceil(rows / W)).
inline torch::Tensor owned_rows(const torch::Tensor& full, int rank, int world_size) {
  const RowLayout l = row_layout(full.sizes(), world_size);
  if (full.dim() == 0) return l.local_rows(rank) == 1 ? full : full.view({1}).narrow(0, 0, 0);
  return full.narrow(0, l.begin(rank), l.local_rows(rank));
}

inline FullyShardOptions test_options() {
  return FullyShardOptions().timeout(collective_timeout());
}

/// A launch with every rank on cuda:0 over Gloo (the testing mode FSDP_TEST_GLOO_CUDA=1), with
/// room for the GPU's start-up: the GlooCuda.* tests'.
inline RunOptions on_one_gpu() {
  RunOptions o;
  o.env["FSDP_TEST_GLOO_CUDA"] = "1";
  o.timeout = std::chrono::seconds(240);
  return o;
}

/// test_options() with `strategy` and, for kHybridShard, its group size S (0: not given).
inline FullyShardOptions test_options(ShardingStrategy strategy, int group) {
  auto o = test_options().strategy(strategy);
  if (group > 0) o.shard_group_size(group);
  return o;
}

/// A parameterized case's name for a strategy at W ranks (and S): "HybridShard_W4_S2".
inline std::string strategy_case_label(ShardingStrategy strategy, int world_size, int group) {
  const char* names[] = {"FullShard", "ShardGradOp", "ShardOptimizerState", "NoShard", "HybridShard"};
  std::string s = std::string(names[static_cast<int>(strategy)]) + "_W" + std::to_string(world_size);
  return group > 0 ? s + "_S" + std::to_string(group) : s;
}

/// Every sharded parameter of `model` (or, with `grads`, its gradient) equals this rank's rows of
/// the same-named parameter (gradient) of the plain reference model. With full sharding a rank's
/// place is its rank among all; a hybrid unit shards over groups of S consecutive ranks (rank % S
/// of S), a replicated one holds all rows.
/// Each parameter's place: (shard rank, shard world size) of its unit on this rank.
inline std::map<std::string, std::pair<int, int>> shard_places(const Rank& r, const FSDPModule& model) {
  std::map<std::string, std::pair<int, int>> place;
  for (const auto& u : model.units()) {
    // From the strategy's traits, not from the unit's own bookkeeping (u.shard_world_size).
    const ShardOver over = traits(u.strategy).shard_over;
    int shard_world = over == ShardOver::kWorld ? r.world_size : over == ShardOver::kNone ? 1 : 0;
    if (over == ShardOver::kGroup) shard_world = static_cast<int>(u.shard_world_size);
    EXPECT_GT(shard_world, 0) << "unit '" << u.name << "'";
    if (shard_world <= 0) continue;
    for (const auto& p : u.params) place[p] = {r.rank % shard_world, shard_world};
  }
  return place;
}

inline void expect_shards_match(const Rank& r, const FSDPModule& model, torch::nn::Module& ref, bool grads = false) {
  auto want = ref.named_parameters();
  const auto place = shard_places(r, model);
  for (const auto& kv : model.named_parameters()) {
    const auto [rank, world] = place.at(kv.key());
    const torch::Tensor& mine = grads ? kv.value().grad() : kv.value();
    const torch::Tensor& theirs = grads ? want[kv.key()].grad() : want[kv.key()];
    if (grads && !theirs.defined()) {
      EXPECT_FALSE(mine.defined()) << "gradient of " << kv.key() << " on rank " << r.rank;
      continue;
    }
    ASSERT_TRUE(mine.defined()) << (grads ? "gradient of " : "") << kv.key() << " on rank " << r.rank;
    EXPECT_TRUE(close(mine.detach(), owned_rows(theirs.detach(), rank, world)))
        << (grads ? "gradient of " : "parameter ") << kv.key() << " on rank " << r.rank;
  }
}

/// Between steps: no unit is gathered, and every parameter of the module (model->parameters())
/// is this rank's rows of the same-named parameter of the plain reference model, with a gradient
/// of that shape when it has one.
inline void expect_between_steps(const Rank& r, const FSDPModule& model, torch::nn::Module& ref) {
  for (const auto& u : model.units()) EXPECT_FALSE(u.unsharded) << "unit '" << u.name << "' on rank " << r.rank;
  auto want = ref.named_parameters();
  const auto place = shard_places(r, model);
  for (const auto& kv : model.named_parameters()) {
    const auto [rank, world] = place.at(kv.key());
    const auto shape = owned_rows(want[kv.key()], rank, world).sizes();
    EXPECT_EQ(kv.value().sizes(), shape) << kv.key() << " on rank " << r.rank;
    if (kv.value().grad().defined()) EXPECT_EQ(kv.value().grad().sizes(), shape) << "gradient of " << kv.key();
  }
}

/// In-process tests of the launcher environment: every variable the library reads at start-up is
/// unset before and after each test (each ctest entry is its own process).
class LauncherEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kVars) unsetenv(v);
  }
  void TearDown() override {
    for (const char* v : kVars) unsetenv(v);
  }
  static constexpr const char* kVars[] = {"RANK",         "WORLD_SIZE",          "LOCAL_RANK",
                                          "MASTER_ADDR",  "MASTER_PORT",         "SLURM_PROCID",
                                          "SLURM_NTASKS", "SLURM_LOCALID",       "FSDP_TIMEOUT",
                                          "FSDP_JOB_ID",  "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"};
};

/// Collects the warnings (TORCH_WARN) issued on this thread while it lives.
class WarningCapture : public c10::WarningHandler {
 public:
  WarningCapture() : previous_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(this);
  }
  ~WarningCapture() override { c10::WarningUtils::set_warning_handler(previous_); }
  void process(const c10::Warning& w) override { text_ += w.msg() + "\n"; }
  const std::string& text() const { return text_; }

 private:
  c10::WarningHandler* previous_;
  std::string text_;
};

/// Runs `fn` and returns the message of the c10::Error it throws ("" if none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace fsdp::testing
