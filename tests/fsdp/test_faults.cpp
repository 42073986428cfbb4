// Faults an operator meets mid-training: a peer killed or stopped (SIGSTOP) inside a collective,
// ranks that take different paths through the program. Every rank must end with the library's
// error, within the timeout, naming the rank, the operation, the group and (where known) the
// peer; never a hang and never a terminate() from a backend thread.
#include "tests/models.h"

#include <torch/nn/functional/loss.h>

#include <csignal>
#include <thread>

namespace fsdp::testing {
namespace {

using Clock = std::chrono::steady_clock;

const gpt::Config kCfg{23, 6, 2, 2, 12, true};

std::pair<torch::Tensor, torch::Tensor> batch(int seed) {
  torch::manual_seed(seed);
  auto tok = torch::randint(kCfg.vocab_size, {kGlobalBatch, kCfg.block_size + 1}, torch::kLong);
  return {tok.narrow(1, 0, kCfg.block_size), tok.narrow(1, 1, kCfg.block_size)};
}

torch::Tensor loss_of(fsdp::FullyShardedModule<gpt::GPTImpl<true>>& model, const Rank& r, int seed) {
  auto [x, y] = batch(seed);
  auto logits = model(local_rows(x, r.rank, r.world_size));
  return torch::nn::functional::cross_entropy(logits.flatten(0, 1), local_rows(y, r.rank, r.world_size).flatten());
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// A rank killed mid-step: every other rank gets an error naming the collective and the dead peer,
// at once, instead of hanging.
TEST(Faults, PeerKilledMidStep) {
  RunOptions opts;
  opts.collective_timeout = std::chrono::seconds(10);
  opts.may_die = {2};
  run_ranks(
      3,
      [](Rank& r) {
        auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
        auto loss = loss_of(model, r, 7);
        if (r.rank == 2) std::raise(SIGKILL);  // dies between forward and backward
        const auto start = Clock::now();
        auto msg = error_of([&] { loss.backward(); });
        std::cout << "error after " << seconds_since(start) << " s: " << msg << std::endl;
        EXPECT_LT(seconds_since(start), 6.0) << "a dead peer is seen at once (plus the peer check)";
        EXPECT_NE(msg.find("failed on global rank " + std::to_string(r.rank) + " of 3"), std::string::npos) << msg;
        EXPECT_NE(msg.find("backward #1"), std::string::npos) << msg;
        EXPECT_NE(msg.find("Peer rank 2 ("), std::string::npos) << msg;
        EXPECT_NE(msg.find("stopped answering"), std::string::npos) << msg;
        // From now on the ranks disagree on which collective comes next: every step refuses to run.
        auto again = error_of([&] { loss_of(model, r, 8); });
        EXPECT_NE(again.find("an earlier collective of this model failed"), std::string::npos) << again;
      },
      opts);
}

/// Two units and a root head; `on_a_output` lets a test hook unit a's output.
struct TwoUnitsImpl : torch::nn::Module {
  TwoUnitsImpl()
      : a(register_module("a", fsdp::Sharded<torch::nn::LinearImpl>(8, 8))),
        b(register_module("b", fsdp::Sharded<torch::nn::LinearImpl>(8, 8))),
        head(register_module("head", torch::nn::Linear(8, 1))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (b_first) return head(torch::tanh(a(torch::tanh(b(x)))));
    auto h = skip_a ? x : a(x);
    if (on_a_output) on_a_output(h);
    return head(torch::tanh(b(torch::tanh(h))));
  }
  fsdp::Sharded<torch::nn::LinearImpl> a, b;
  torch::nn::Linear head;
  std::function<void(torch::Tensor&)> on_a_output;
  bool b_first = false;  // the units in the other order (they have the same shapes)
  bool skip_a = false;   // unit a not called
};

// A peer stopped (SIGSTOP) while the others wait in a reduce-scatter. The process group's own
// timeout is long (60 s) and FullyShardOptions::timeout short (3 s): Gloo's reduce-scatter ignores
// the timeout given to its wait(), so the library bounds the wait itself. Tearing down the model
// and the process group then returns at once, although Gloo's threads are still inside the
// collective.
TEST(Faults, StoppedPeerFailsTheReduceScatterWithinTheOptionsTimeout) {
  RunOptions opts;
  opts.collective_timeout = std::chrono::seconds(60);  // the process group's timeout
  opts.timeout = std::chrono::seconds(90);
  opts.may_die = {1};
  run_ranks(
      2,
      [](Rank& r) {
        torch::manual_seed(0);
        auto net = std::make_shared<TwoUnitsImpl>();
        auto model = std::make_unique<fsdp::FullyShardedModule<TwoUnitsImpl>>(
            fsdp::fully_shard(net, r.pg, FullyShardOptions().timeout(std::chrono::seconds(3)).prefetch(0)));
        auto x = torch::randn({4, 8});
        (*model)(x).sum().backward();  // a healthy step first
        // Rank 1 stops when the gradient reaches unit a's output: the library's own hook there ran
        // first (a is gathered on both ranks); rank 0 goes on to reduce a's gradients, alone.
        if (r.rank == 1) {
          net->on_a_output = [](torch::Tensor& h) {
            h.register_hook([](const torch::Tensor&) { std::raise(SIGSTOP); });
          };
        }
        auto loss = (*model)(x).sum();
        const auto start = Clock::now();
        auto msg = error_of([&] { loss.backward(); });
        const double waited = seconds_since(start);
        std::cout << "error after " << waited << " s: " << msg << std::endl;
        ASSERT_FALSE(msg.empty()) << "backward did not fail";
        EXPECT_GT(waited, 2.5) << msg;
        EXPECT_LT(waited, 3.0 + 1.5) << "the option's 3 s timeout, plus the peer check\n" << msg;
        EXPECT_NE(msg.find("reduce-scatter of gradients of unit '"), std::string::npos) << msg;
        EXPECT_NE(msg.find("failed on global rank 0 of 2"), std::string::npos) << msg;
        EXPECT_NE(msg.find("(timeout 3000 ms)"), std::string::npos) << msg;
        EXPECT_NE(msg.find("Peer rank 1 ("), std::string::npos) << msg;
        const auto teardown = Clock::now();
        loss = torch::Tensor();
        model.reset();
        net.reset();
        r.pg.reset();
        EXPECT_LT(seconds_since(teardown), 1.0) << "destroying the model and the process group after a timeout";
      },
      opts);
}

// Under hybrid sharding, a failure inside a group names this rank's global rank, its place in the
// group and the group's members; the dead peer by its global rank.
TEST(Faults, HybridErrorsNameGlobalRanks) {
  RunOptions opts;
  opts.collective_timeout = std::chrono::seconds(10);
  opts.may_die = {3};
  run_ranks(
      4,
      [](Rank& r) {
        torch::manual_seed(0);
        auto net = std::make_shared<TwoUnitsImpl>();
        auto model = fsdp::fully_shard(
            net, r.pg, test_options().strategy(ShardingStrategy::kHybridShard).shard_group_size(2).prefetch(0));
        auto x = torch::randn({4, 8});
        model(x).sum().backward();
        if (r.rank == 3) {  // dies inside backward, after unit a was gathered
          net->on_a_output = [](torch::Tensor& h) {
            h.register_hook([](const torch::Tensor&) { std::raise(SIGKILL); });
          };
        }
        auto loss = model(x).sum();
        auto msg = error_of([&] { loss.backward(); });
        std::cout << "error: " << msg << std::endl;
        EXPECT_NE(msg.find("failed on global rank " + std::to_string(r.rank) + " of 4"), std::string::npos) << msg;
        EXPECT_NE(msg.find("Peer rank 3 ("), std::string::npos) << msg;
        if (r.rank == 2) {  // rank 3's shard group: a's reduce-scatter inside it
          EXPECT_NE(msg.find("(rank 0 of hybrid shard group 1: global ranks 2, 3)"), std::string::npos) << msg;
        }
      },
      opts);
}

/// Ranks that take different paths: one skips backward and runs another forward, the other goes
/// on into backward. Both get the library's error at the next step boundary, naming what each
/// rank was doing; no collective of mismatched size reaches Gloo (whose transport thread would
/// otherwise terminate the process).
TEST(Faults, RankSkippingBackwardFailsEveryRank) {
  run_ranks(2, [](Rank& r) {
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
    loss_of(model, r, 1).backward();
    auto loss = loss_of(model, r, 2);
    auto msg = error_of([&] {
      if (r.rank == 0) {
        loss.backward();
      } else {
        loss_of(model, r, 3);  // an extra forward instead of the backward
      }
    });
    std::cout << "error: " << msg << std::endl;
    EXPECT_NE(msg.find("the ranks took different paths"), std::string::npos) << msg;
    EXPECT_NE(msg.find("global rank 0: the start of backward #2"), std::string::npos) << msg;
    EXPECT_NE(msg.find("global rank 1: forward #3 of the wrapped model"), std::string::npos) << msg;
    EXPECT_NE(msg.find("seen on global rank " + std::to_string(r.rank) + " of 2"), std::string::npos) << msg;
    auto again = error_of([&] { loss_of(model, r, 4); });
    EXPECT_NE(again.find("an earlier collective of this model failed"), std::string::npos) << again;
  });
}

/// One rank clips, the other does not: caught at the clipping call's check.
TEST(Faults, RankSkippingClippingFailsEveryRank) {
  run_ranks(2, [](Rank& r) {
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
    loss_of(model, r, 1).backward();
    auto msg = error_of([&] {
      if (r.rank == 0) fsdp::optim::clip_grad_norm(model, 1.0);
      loss_of(model, r, 2);
    });
    std::cout << "error: " << msg << std::endl;
    EXPECT_NE(msg.find("the ranks took different paths"), std::string::npos) << msg;
    EXPECT_NE(msg.find("global rank 0: fsdp::optim::clip_grad_norm (norm_type 2)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("global rank 1: forward #2"), std::string::npos) << msg;
  });
}

/// Gradient sync on one rank and off on the other: the backwards would issue different collectives.
TEST(Faults, GradientSyncDifferingFailsEveryRank) {
  run_ranks(2, [](Rank& r) {
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
    model.set_requires_gradient_sync(r.rank == 0);
    auto loss = loss_of(model, r, 1);
    auto msg = error_of([&] { loss.backward(); });
    EXPECT_NE(msg.find("global rank 0: the start of backward #1 (gradient sync on)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("global rank 1: the start of backward #1 (gradient sync off)"), std::string::npos) << msg;
  });
}

/// A unit skipped on one rank inside forward: the next collectives are another unit's, which only
/// a check before every collective can catch in time (FullyShardOptions::verify_collectives).
/// (A unit called alone, outside the model's forward, is refused by the unit itself:
/// EdgeCases.BlockCalledAroundItsWrapper.)
TEST(Faults, SkippedUnitIsNamedWithVerifyCollectives) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    auto net = std::make_shared<TwoUnitsImpl>();
    auto model = fsdp::fully_shard(net, r.pg, test_options().verify_collectives(true).prefetch(0));
    auto x = torch::randn({4, 8});
    model(x).sum().backward();
    net->skip_a = r.rank == 1;  // a different forward than rank 0's
    auto msg = error_of([&] { model(x).sum().backward(); });
    std::cout << "error: " << msg << std::endl;
    EXPECT_NE(msg.find("the ranks took different paths"), std::string::npos) << msg;
    EXPECT_NE(msg.find("global rank 0: all-gather of unit 'a'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("global rank 1: all-gather of unit 'b'"), std::string::npos) << msg;
  });
}

/// Units of equal sizes run in another order on one rank: every collective pairs up, with the
/// other unit's data. Caught at the start of backward (the collectives since the last check name
/// other units), before any gradient is reduced, instead of training on mixed weights.
TEST(Faults, UnitsInAnotherOrderAreCaughtBeforeBackward) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    auto net = std::make_shared<TwoUnitsImpl>();
    auto model = fsdp::fully_shard(net, r.pg, test_options().prefetch(0));
    auto x = torch::randn({4, 8});
    model(x).sum().backward();
    net->b_first = r.rank == 1;
    auto loss = model(x).sum();  // no error yet: the gathers paired, unit a's with unit b's
    const int64_t reduces = model.comm_stats().reduce_scatters;
    auto msg = error_of([&] { loss.backward(); });
    std::cout << "error: " << msg << std::endl;
    EXPECT_NE(msg.find("the ranks took different paths"), std::string::npos) << msg;
    EXPECT_NE(msg.find("global rank 0: the start of backward #2 (gradient sync on), after 3 collective(s) of this "
                       "model since the previous check (all-gather of unit '<root>', all-gather of unit 'a', "
                       "all-gather of unit 'b')"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("global rank 1: the start of backward #2 (gradient sync on), after 3 collective(s) of this "
                       "model since the previous check (all-gather of unit '<root>', all-gather of unit 'b', "
                       "all-gather of unit 'a')"),
              std::string::npos)
        << msg;
    EXPECT_EQ(model.comm_stats().reduce_scatters, reduces) << "no gradient was reduced";
  });
}

/// A peer that returned from main (it ran fewer steps: uneven data) says so in its last heartbeat.
TEST(Faults, PeerThatExitedIsToldApart) {
  RunOptions opts;
  opts.collective_timeout = std::chrono::seconds(10);
  run_ranks(
      2,
      [](Rank& r) {
        auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
        loss_of(model, r, 1).backward();
        if (r.rank == 1) return;  // one step fewer
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        auto msg = error_of([&] { loss_of(model, r, 2).backward(); });
        std::cout << "error: " << msg << std::endl;
        EXPECT_NE(msg.find("Peer rank 1 ("), std::string::npos) << msg;
        EXPECT_NE(msg.find("has exited: its process exited (it returned from main"), std::string::npos) << msg;
      },
      opts);
}

}  // namespace
}  // namespace fsdp::testing
