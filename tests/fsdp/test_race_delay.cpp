// The race switch (FSDP_RACE_DELAY, fsdp/internal/race_delay.h): with seeded delays on both sides
// of every collective, training gives bit-identical losses, gradients and weights to the run
// without them, for every strategy, prefetch 2, bf16, activation checkpointing and accumulation, at
// 2 and 4 ranks (all cases of a world size in one launch); and a wait removed on purpose (a unit
// that copies out its gather before waiting for it) gives different numbers for every seed tried.
// The variable itself, and the count printed at exit, are checked through train_gpt
// (tests/examples/check_race_and_device.py); the tensor-parallel mesh in tests/tp.
//
// GlooCuda.*: the same cases with every rank on cuda:0 over Gloo (FSDP_TEST_GLOO_CUDA=1, the
// testing mode of several ranks on one GPU), CPU offload besides, against plain LibTorch on the GPU
// and bit-identical with the race switch on; for scripts/gpu-check.sh, skipped without a GPU.
#include "fsdp/internal/race_delay.h"
#include "tests/parity.h"

#include <torch/cuda.h>

namespace fsdp::testing {
namespace {

struct Case {
  ShardingStrategy strategy;
  int prefetch = 1;
  bool bf16 = false;
  int checkpoint_every = 0;
  int micro = 1;
  bool offload = false;  // CPUOffloadPolicy: a GPU model only
};

std::string describe(const Case& c, int world_size) {
  std::ostringstream os;
  os << strategy_case_label(c.strategy, world_size, 0) << ", prefetch " << c.prefetch << (c.bf16 ? ", bf16" : "")
     << (c.checkpoint_every ? ", activation checkpointing" : "") << (c.micro > 1 ? ", accumulation" : "")
     << (c.offload ? ", CPU offload" : "");
  return os.str();
}

const gpt::Config kConfig{29, 8, 3, 2, 12, true};
constexpr int kSteps = 3;

struct Trace {
  std::vector<at::Tensor> losses, grads, params;  // this rank's, on the CPU
  std::vector<double> global;                     // the loss of each step's global batch
};

Trace train_on(Rank& r, const Case& c, const torch::Device& dev) {
  const bool hybrid = c.strategy == ShardingStrategy::kHybridShard;
  auto options = test_options(c.strategy, hybrid ? r.world_size / 2 : 0)
                     .prefetch(c.prefetch)
                     .activation_checkpointing_every(c.checkpoint_every);
  // Replicated: small buckets, so that most are all-reduced while backward still runs.
  if (c.strategy == ShardingStrategy::kNoShard) options.bucket_bytes(256);
  if (c.bf16) {
    options.mixed_precision(traits(c.strategy).params_sharded ? MixedPrecisionPolicy().param_dtype(torch::kBFloat16)
                                                              : MixedPrecisionPolicy().reduce_dtype(torch::kBFloat16));
  }
  if (c.offload) options.offload_policy(CPUOffloadPolicy());
  torch::manual_seed(0);
  auto model = fsdp::fully_shard(gpt::make_gpt_on<true>(kConfig, dev), r.pg, options);
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
  Trace t;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    for (int m = 0; m < c.micro; ++m) {
      model.set_requires_gradient_sync(m == c.micro - 1);
      auto [x, y] = gpt_batch(kConfig, 600 + 10 * step + m);
      auto loss =
          gpt_loss(model(local_rows(x, r.rank, r.world_size).to(dev)), local_rows(y, r.rank, r.world_size).to(dev));
      (loss / c.micro).backward();
      t.losses.push_back(loss.detach().cpu());
      auto global = t.losses.back().clone();
      all_reduce_sum(r, global);
      t.global.push_back(global.item<double>() / r.world_size);
    }
    for (const auto& p : model.parameters()) t.grads.push_back(p.grad().defined() ? p.grad().cpu() : at::Tensor());
    opt.step();
  }
  for (const auto& p : model.parameters()) t.params.push_back(p.detach().cpu());
  return t;
}

// On a GPU the compute runs on a stream of its own: Gloo's worker thread makes the default stream
// wait for each CUDA collective it completes, which could hide a missing wait.
Trace train(Rank& r, const Case& c, const torch::Device& dev = torch::kCPU) {
  Trace t;
  detail::on_pool_stream_for_testing(dev, [&] { t = train_on(r, c, dev); });
  return t;
}

// Plain LibTorch on `dev` on the whole batch: each step's loss.
std::vector<double> train_plain(const torch::Device& dev) {
  torch::manual_seed(0);
  auto net = gpt::make_gpt_on<false>(kConfig, dev);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    auto [x, y] = gpt_batch(kConfig, 600 + 10 * step);
    auto loss = gpt_loss(net->forward(x.to(dev)), y.to(dev));
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

// The first place where two traces differ ("" when bit-identical).
std::string first_difference(const Trace& a, const Trace& b) {
  auto compare = [](const std::vector<at::Tensor>& x, const std::vector<at::Tensor>& y,
                    const std::string& what) -> std::string {
    if (x.size() != y.size()) return what + " count";
    for (size_t i = 0; i < x.size(); ++i) {
      if (x[i].defined() != y[i].defined()) return what + " " + std::to_string(i) + " (defined on one side only)";
      if (x[i].defined() && !torch::equal(x[i], y[i])) return what + " " + std::to_string(i);
    }
    return "";
  };
  for (auto d : {compare(a.losses, b.losses, "loss"), compare(a.grads, b.grads, "gradient"),
                 compare(a.params, b.params, "parameter")}) {
    if (!d.empty()) return d;
  }
  return "";
}

// Every case twice, the switch off then on (a seed of its own per case): bit-identical, and the
// delays were applied. With `plain` (each step's loss of plain LibTorch on the whole batch), the
// run without delays matches it too: fp32 to 1e-5, bf16 to 3e-2 (means over other rows).
void check_cases(Rank& r, const std::vector<Case>& cases, const torch::Device& dev = torch::kCPU,
                 const std::vector<double>& plain = {}) {
  uint64_t seed = 7;
  for (const Case& c : cases) {
    const std::string label = "rank " + std::to_string(r.rank) + ", " + describe(c, r.world_size) + " on " + dev.str();
    ASSERT_EQ(detail::set_race_delay_for_testing(0), 0u);
    const Trace off = train(r, c, dev);
    if (!plain.empty() && c.micro == 1) {
      const double tol = c.bf16 ? 3e-2 : 1e-5;
      for (size_t s = 0; s < plain.size(); ++s) {
        EXPECT_NEAR(off.global[s], plain[s], tol * std::abs(plain[s])) << label << ", step " << s;
      }
    }
    const int64_t before = detail::race_delays_applied();
    detail::set_race_delay_for_testing(seed++);
    const Trace on = train(r, c, dev);
    detail::set_race_delay_for_testing(0);
    EXPECT_GT(detail::race_delays_applied(), before) << label;
    const std::string d = first_difference(on, off);
    EXPECT_TRUE(d.empty()) << label << ": with race delays " << d << " differs from the run without them";
  }
}

constexpr auto kFull = ShardingStrategy::kFullShard;

// A wait removed on purpose: every unit copies out its gather before waiting for it. With the
// switch on, the copy reads the buffer before the collective wrote it, for every seed in `seeds`.
void expect_early_reads_seen(Rank& r, const std::vector<uint64_t>& seeds, const torch::Device& dev = torch::kCPU) {
  ASSERT_EQ(detail::set_race_delay_for_testing(0), 0u);
  const Trace right = train(r, {kFull, 2}, dev);
  detail::read_gathers_before_wait_for_testing(true);
  for (uint64_t seed : seeds) {
    detail::set_race_delay_for_testing(seed);
    const Trace early = train(r, {kFull, 2}, dev);
    EXPECT_FALSE(first_difference(early, right).empty())
        << "rank " << r.rank << " on " << dev << ": a unit that reads its gather before waiting for it trained the "
        << "same numbers with FSDP_RACE_DELAY=" << seed;
  }
  detail::read_gathers_before_wait_for_testing(false);
  detail::set_race_delay_for_testing(0);
}

constexpr auto kGradOp = ShardingStrategy::kShardGradOp;
constexpr auto kZero1 = ShardingStrategy::kShardOptimizerState;
constexpr auto kDDP = ShardingStrategy::kNoShard;
constexpr auto kHybrid = ShardingStrategy::kHybridShard;

TEST(RaceDelay, ChangesNothingAtTwoRanks) {
  run_ranks(2, [](Rank& r) {
    check_cases(r, {{kFull, 2},
                    {kGradOp, 2},
                    {kZero1, 2},
                    {kDDP, 2},
                    {kHybrid, 2},
                    {kFull, 0, true},
                    {kFull, 2, false, 1},
                    {kGradOp, 1, true, 1},
                    {kFull, 1, false, 0, 2}});

    expect_early_reads_seen(r, {1, 2, 3});
  });
}

TEST(RaceDelay, ChangesNothingAtFourRanks) {
  run_ranks(4, [](Rank& r) {
    check_cases(r, {{kFull, 2}, {kGradOp, 2}, {kZero1, 2}, {kDDP, 2}, {kHybrid, 2}, {kFull, 2, true, 1}});
  });
}

bool have_cuda() {
  return torch::cuda::is_available();
}

TEST(GlooCuda, TwoRanksOnOneGpu) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  run_ranks(
      2,
      [](Rank& r) {
        const torch::Device dev = fsdp::cuda_device();
        ASSERT_EQ(dev, torch::Device(torch::kCUDA, 0));
        check_cases(r,
                    {{kFull, 0},
                     {kFull, 1},
                     {kFull, 2},
                     {kGradOp, 2},
                     {kZero1, 2},
                     {kDDP, 2},
                     {kHybrid, 2},
                     {kFull, 2, true},
                     {kFull, 2, false, 1},
                     {kFull, 1, false, 0, 2},
                     {kFull, 1, false, 0, 1, true}},
                    dev, train_plain(dev));
        expect_early_reads_seen(r, {5}, dev);  // the wait removed on purpose shows on the GPU too
      },
      on_one_gpu());
}

TEST(GlooCuda, FourRanksOnOneGpu) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  run_ranks(
      4,
      [](Rank& r) {
        const torch::Device dev = fsdp::cuda_device();
        check_cases(r, {{kFull, 2}, {kGradOp, 2}, {kZero1, 2}, {kDDP, 2}, {kHybrid, 2}, {kFull, 2, true, 1}}, dev,
                    train_plain(dev));
      },
      on_one_gpu());
}

// Without a GPU the testing mode is refused at start-up, naming the variable.
TEST(GlooCuda, RefusedWithoutAGpu) {
  if (have_cuda()) GTEST_SKIP() << "this machine has a CUDA device";
  RunOptions o = on_one_gpu();
  o.init_process_group = false;
  run_ranks(
      1,
      [](Rank&) {
        const std::string e = error_of([] { init_process_group(InitOptions().rank(0).world_size(1)); });
        EXPECT_NE(e.find("fsdp::init_process_group (rank 0 of 1): FSDP_TEST_GLOO_CUDA=1 asks for the testing mode of "
                         "several ranks on one GPU over Gloo, but this machine shows no CUDA device"),
                  std::string::npos)
            << e;
        const std::string d = error_of([] { fsdp::cuda_device(); });
        EXPECT_NE(d.find("fsdp::cuda_device (rank 0 of 1): this machine shows no CUDA device"), std::string::npos) << d;
      },
      o);
}

// A bad seed in the environment: refused by fsdp::init_process_group, before any rendezvous, as its
// own error (the call and this rank's place in the message and in the error's fields).
TEST(RaceDelay, ABadSeedIsRefusedAtStartUp) {
  RunOptions o;
  o.env["FSDP_RACE_DELAY"] = "seven";
  o.init_process_group = false;
  run_ranks(
      1,
      [](Rank&) {
        try {
          init_process_group(InitOptions().rank(0).world_size(1));
          ADD_FAILURE() << "FSDP_RACE_DELAY=seven was accepted";
        } catch (const Error& e) {
          const std::string m = e.what_without_backtrace();
          EXPECT_EQ(m.rfind("fsdp::init_process_group (rank 0 of 1): FSDP_RACE_DELAY='seven' is not a race-delay "
                            "seed: give a whole number of at most 18 digits",
                            0),
                    0u)
              << m;
          EXPECT_EQ(e.api(), "fsdp::init_process_group");
          EXPECT_EQ(e.rank(), 0);
        }
      },
      o);
}

TEST(RaceDelay, ASeedThatIsNotAWholeNumberIsRefused) {
  EXPECT_EQ(detail::parse_race_delay("0", "FSDP_RACE_DELAY"), 0u);
  EXPECT_EQ(detail::parse_race_delay("7", "FSDP_RACE_DELAY"), 7u);
  for (const char* bad : {"seven", "-1", "1.5", " 7", "123456789012345678901"}) {
    const std::string e = error_of([&] { detail::parse_race_delay(bad, "FSDP_RACE_DELAY"); });
    EXPECT_NE(e.find(std::string("FSDP_RACE_DELAY='") + bad + "' is not a race-delay seed: give a whole number"),
              std::string::npos)
        << e;
  }
}

}  // namespace
}  // namespace fsdp::testing
