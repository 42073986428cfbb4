// Errors: a model that differs between ranks, bad launcher environments, misuse at wrap time.
// Each says what, where and on which rank, and none hangs.
#include "tests/models.h"

#include "fsdp/internal/monitor.h"

#include <thread>

#include <cstdlib>

namespace fsdp::testing {
namespace {

using Clock = std::chrono::steady_clock;

struct DifferentMLPImpl : torch::nn::Module {
  explicit DifferentMLPImpl(int64_t hidden, const std::string& second = "fc2")
      : fc1(register_module("fc1", fsdp::Sharded<torch::nn::LinearImpl>(7, hidden))),
        fc2(register_module(second, fsdp::Sharded<torch::nn::LinearImpl>(hidden, 5))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(fc1(x)); }
  fsdp::Sharded<torch::nn::LinearImpl> fc1, fc2;
};

TEST(Errors, ModelWithOtherShapeOnOneRank) {
  run_ranks(3, [](Rank& r) {
    const auto start = Clock::now();
    std::string api;  // the error's api(), beside its text
    auto msg = error_of([&] {
      try {
        auto m = std::make_shared<DifferentMLPImpl>(r.rank == 1 ? 14 : 13);
        fsdp::fully_shard(m, r.pg, test_options());
      } catch (const fsdp::Error& e) {
        api = e.api();
        throw;
      }
    });
    EXPECT_EQ(api, "fsdp::fully_shard") << msg;
    EXPECT_NE(msg.find("differs between ranks"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'fc1.weight'"), std::string::npos) << msg;
    EXPECT_NE(
        msg.find(
            "is float [13, 7] in unit 'fc1' (full-shard) (cpu) on rank 0 but float [14, 7] in unit 'fc1' (full-shard) "
            "(cpu) on rank 1"),
        std::string::npos)
        << msg;
    EXPECT_NE(msg.find("(rank " + std::to_string(r.rank) + " of 3)"), std::string::npos) << msg;
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(30));
  });
}

TEST(Errors, ModelWithOtherNameOnOneRank) {
  run_ranks(2, [](Rank& r) {
    auto msg = error_of([&] {
      auto m = std::make_shared<DifferentMLPImpl>(13, r.rank == 1 ? "out" : "fc2");
      fsdp::fully_shard(m, r.pg, test_options());
    });
    EXPECT_NE(msg.find("is 'fc2.weight' on rank 0 but 'out.weight' on rank 1"), std::string::npos) << msg;
  });
}

/// fc2 is a unit on rank 0 only: same names and shapes, different collectives.
struct MaybeShardedImpl : torch::nn::Module {
  explicit MaybeShardedImpl(bool shard_fc2) {
    fc1 = register_module("fc1", fsdp::Sharded<torch::nn::LinearImpl>(7, 13));
    if (shard_fc2) {
      register_module("fc2", fsdp::Sharded<torch::nn::LinearImpl>(13, 5));
    } else {
      register_module("fc2", torch::nn::Linear(13, 5));
    }
  }
  fsdp::Sharded<torch::nn::LinearImpl> fc1{nullptr};
};

TEST(Errors, UnitOnOneRankOnly) {
  run_ranks(2, [](Rank& r) {
    auto msg =
        error_of([&] { fsdp::fully_shard(std::make_shared<MaybeShardedImpl>(r.rank == 0), r.pg, test_options()); });
    EXPECT_NE(msg.find("'fc2.weight' is float [5, 13] in unit 'fc2' (full-shard) (cpu) on rank 0 but float [5, 13] in "
                       "unit '<root>'"),
              std::string::npos)
        << msg;
  });
}

TEST(Errors, StrategyDiffersOnOneRank) {
  run_ranks(2, [](Rank& r) {
    auto m = std::make_shared<DifferentMLPImpl>(13);
    if (r.rank == 1) m->fc2->set_sharding_strategy(ShardingStrategy::kShardGradOp);
    auto msg = error_of([&] { fsdp::fully_shard(m, r.pg, test_options()); });
    EXPECT_NE(msg.find("in unit 'fc2' (full-shard) (cpu) on rank 0 but float [5, 13] in unit 'fc2' (shard-grad-op)"),
              std::string::npos)
        << msg;
    auto wrapped = std::make_shared<DifferentMLPImpl>(13);
    fsdp::fully_shard(wrapped, r.pg, test_options());
    auto late = error_of([&] { wrapped->fc1->set_sharding_strategy(ShardingStrategy::kShardGradOp); });
    EXPECT_NE(late.find("fsdp (rank " + std::to_string(r.rank) +
                        " of 2): set_sharding_strategy(shard-grad-op) on unit 'fc1', which is sharded already (as "
                        "full-shard). Call it before fsdp::fully_shard"),
              std::string::npos)
        << late;
  });
}

// Every option that changes the sequence or sizes of collectives is compared when wrapping: a
// difference fails every rank within seconds, naming the option (prefetch differing used to hang
// until the timeout; bucket_bytes differing aborted inside Gloo's thread).
TEST(Errors, OptionsDifferingBetweenRanks) {
  run_ranks(2, [](Rank& r) {
    struct Case {
      FullyShardOptions mine;
      std::string expected;
    };
    const std::vector<Case> cases = {
        {test_options().prefetch(r.rank == 0 ? 1 : 2), "option 'prefetch' is 1 on rank 0 but 2 on rank 1"},
        {test_options().strategy(ShardingStrategy::kNoShard).bucket_bytes(r.rank == 0 ? 64 : 128),
         "option 'bucket_bytes' is 64 on rank 0 but 128 on rank 1"},
        {test_options().sync_module_states(r.rank == 0),
         "option 'sync_module_states' is true on rank 0 but false on rank 1"},
        {test_options().verify_collectives(r.rank == 1),
         "option 'verify_collectives' is false on rank 0 but true on rank 1"},
        {r.rank == 0 ? test_options().device(torch::kCPU) : test_options(),
         "option 'device' is cpu on rank 0 but unset on rank 1"},
    };
    for (const auto& c : cases) {
      const auto start = Clock::now();
      auto msg = error_of([&] { fsdp::fully_shard(std::make_shared<DifferentMLPImpl>(13), r.pg, c.mine); });
      EXPECT_NE(msg.find(c.expected), std::string::npos) << msg;
      EXPECT_NE(msg.find("(rank " + std::to_string(r.rank) + " of 2)"), std::string::npos) << msg;
      EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
    }
    // The same through a ShardingScope: the unit built first is checked with the options, and the
    // error names the scope and the unit (fully_shard was never called).
    std::string api;
    auto msg = error_of([&] {
      try {
        fsdp::ShardingScope scope(r.pg, test_options().prefetch(r.rank));
        DifferentMLPImpl built(13);
      } catch (const fsdp::Error& e) {
        api = e.api();
        throw;
      }
    });
    EXPECT_EQ(api, "fsdp::ShardingScope") << msg;
    EXPECT_NE(msg.find("the model differs between ranks in "), std::string::npos) << msg;
    EXPECT_NE(msg.find("LinearImpl #1 (built in a ShardingScope): option 'prefetch' is 0 on rank 0 but 1 on rank 1"),
              std::string::npos)
        << msg;
  });
}

/// A module buffer drawn from the RNG (a fixed random projection, a mask).
struct BufferedImpl : torch::nn::Module {
  explicit BufferedImpl(int64_t n = 6, torch::Dtype dtype = torch::kFloat)
      : fc(register_module("fc", fsdp::Sharded<torch::nn::LinearImpl>(n, n))),
        mix(register_buffer("mix", torch::randn({n, n}, dtype))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc(x.matmul(mix)); }
  fsdp::Sharded<torch::nn::LinearImpl> fc;
  torch::Tensor mix;
};

// Buffers are broadcast from rank 0 like the parameters (PyTorch's FSDP and DDP do it), so ranks
// seeded differently train the same model; their names, shapes and dtypes are part of the check.
TEST(Errors, BuffersAreBroadcastAndChecked) {
  run_ranks(3, [](Rank& r) {
    torch::manual_seed(100 + r.rank);  // differs between ranks: parameters and the buffer
    auto net = std::make_shared<BufferedImpl>();
    auto model = fsdp::fully_shard(net, r.pg, test_options());
    // Rank 0's buffer everywhere; and with it, rank 0's model trains like the reference.
    auto rank0_mix = net->mix.clone();
    all_reduce_sum(r, rank0_mix);
    EXPECT_TRUE(rank0_mix.equal(net->mix * 3)) << "the buffer differs between ranks after fully_shard";
    torch::manual_seed(100);
    auto ref0 = std::make_shared<BufferedImpl>();  // rank 0's initial model, plain LibTorch
    torch::optim::SGD ref_opt(ref0->parameters(), 0.1), opt(model.parameters(), 0.1);
    torch::manual_seed(7);
    auto x = torch::randn({kGlobalBatch, 6});
    for (int step = 0; step < 3; ++step) {
      ref_opt.zero_grad();
      ref0->forward(x).pow(2).mean().backward();
      ref_opt.step();
      opt.zero_grad();
      model(local_rows(x, r.rank, r.world_size)).pow(2).mean().backward();
      opt.step();
    }
    expect_shards_match(r, model, *ref0);
    // A buffer of another shape on one rank: named on every rank.
    auto msg =
        error_of([&] { fsdp::fully_shard(std::make_shared<BufferedImpl>(r.rank == 2 ? 7 : 6), r.pg, test_options()); });
    EXPECT_NE(msg.find("differs between ranks"), std::string::npos) << msg;
    auto other = error_of([&] {
      auto m = std::make_shared<BufferedImpl>(6, r.rank == 1 ? torch::kDouble : torch::kFloat);
      fsdp::fully_shard(m, r.pg, test_options());
    });
    EXPECT_NE(other.find("buffer 'mix' is float [6, 6] (cpu) on rank 0 but double [6, 6] (cpu) on rank 1"),
              std::string::npos)
        << other;
  });
}

struct UsesWeightImpl : torch::nn::Module {
  explicit UsesWeightImpl(const torch::Tensor& w) : weight(register_parameter("weight", w)) {}
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(weight); }
  torch::Tensor weight;
};

struct SharedAcrossUnitsImpl : torch::nn::Module {
  explicit SharedAcrossUnitsImpl(const torch::Tensor& w = torch::randn({4, 4}))
      : a(register_module("a", fsdp::Sharded<UsesWeightImpl>(w))),
        b(register_module("b", fsdp::Sharded<UsesWeightImpl>(w))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(a(x)); }
  fsdp::Sharded<UsesWeightImpl> a, b;
};

TEST(Errors, ParameterSharedAcrossUnits) {
  run_ranks(1, [](Rank& r) {
    auto msg = error_of([&] { fsdp::fully_shard(std::make_shared<SharedAcrossUnitsImpl>(), r.pg, test_options()); });
    EXPECT_NE(msg.find("'a.weight' is shared with 'b.weight'"), std::string::npos) << msg;
  });
}

TEST(Errors, RootMustNotBeAShardedUnit) {
  run_ranks(1, [](Rank& r) {
    auto msg = error_of([&] { fsdp::fully_shard(fsdp::Sharded<torch::nn::LinearImpl>(3, 3), r.pg, test_options()); });
    EXPECT_NE(msg.find("root module is itself an fsdp::Sharded unit"), std::string::npos) << msg;
  });
}

TEST(Errors, WrappingTwice) {
  run_ranks(1, [](Rank& r) {
    auto m = std::make_shared<UnevenMLPImpl<true>>();
    fsdp::fully_shard(m, r.pg, test_options());
    auto msg = error_of([&] { fsdp::fully_shard(m, r.pg, test_options()); });
    EXPECT_NE(msg.find("wrap a model once"), std::string::npos) << msg;
  });
}

// ---- Launcher environment (in-process: each ctest entry is its own process) --------------------

class Env : public LauncherEnv {};

TEST_F(Env, NoLauncherIsOneProcess) {
  auto env = read_launch_env();
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.launcher, "none");
  auto pg = init_process_group();
  EXPECT_EQ(pg->getSize(), 1);
  auto t = torch::ones({3});
  fsdp::all_reduce(pg, t);
  EXPECT_TRUE(t.equal(torch::ones({3})));
}

TEST_F(Env, MissingWorldSize) {
  setenv("RANK", "0", 1);
  auto msg = error_of([] { read_launch_env(); });
  EXPECT_NE(msg.find("WORLD_SIZE is not set"), std::string::npos) << msg;
  EXPECT_NE(msg.find("torchrun"), std::string::npos) << msg;
}

TEST_F(Env, RankNotBelowWorldSize) {
  setenv("RANK", "2", 1);
  setenv("WORLD_SIZE", "2", 1);
  auto msg = error_of([] { read_launch_env(); });
  EXPECT_NE(msg.find("rank 2 is not below the world size 2 (RANK / WORLD_SIZE)"), std::string::npos) << msg;
}

TEST_F(Env, NotAnInteger) {
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "two", 1);
  auto msg = error_of([] { read_launch_env(); });
  EXPECT_NE(msg.find("WORLD_SIZE='two' is not an integer"), std::string::npos) << msg;
}

TEST_F(Env, MissingMasterAddrAndPort) {
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  auto msg = error_of([] { read_launch_env(); });
  EXPECT_NE(msg.find("MASTER_ADDR is not set (rank 1 of 2, from RANK and WORLD_SIZE as torchrun sets them)"),
            std::string::npos)
      << msg;
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  msg = error_of([] { read_launch_env(); });
  EXPECT_NE(msg.find("MASTER_PORT is not set"), std::string::npos) << msg;
  setenv("MASTER_PORT", "70000", 1);
  msg = error_of([] { read_launch_env(); });
  EXPECT_NE(msg.find("MASTER_PORT='70000' is not an integer in [1, 65535]"), std::string::npos) << msg;
}

TEST_F(Env, Slurm) {
  setenv("SLURM_PROCID", "1", 1);
  auto msg = error_of([] { read_launch_env(); });
  EXPECT_NE(msg.find("SLURM_NTASKS is not set"), std::string::npos) << msg;
  setenv("SLURM_NTASKS", "4", 1);
  setenv("SLURM_LOCALID", "1", 1);
  msg = error_of([] { read_launch_env(); });
  EXPECT_NE(msg.find("scontrol show hostnames"), std::string::npos) << msg;
  setenv("MASTER_ADDR", "node7", 1);
  auto env = read_launch_env();
  EXPECT_EQ(env.launcher, "slurm");
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "node7");
  EXPECT_EQ(env.master_port, 29500);
}

TEST_F(Env, TorchrunAgentStore) {
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "29400", 1);
  setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  auto env = read_launch_env();
  EXPECT_EQ(env.launcher, "torchrun");
  EXPECT_TRUE(env.agent_store);  // rank 0 joins torchrun's store as a client
  EXPECT_EQ(env.local_rank, 0);
}

// The torchrun path end to end: RANK/WORLD_SIZE/MASTER_* and a TCPStore hosted by rank 0.
TEST(ProcessGroup, TcpStoreRendezvousFromEnvironment) {
  RunOptions opts;
  opts.rendezvous = "env";
  opts.init_process_group = false;
  run_ranks(
      3,
      [](Rank& r) {
        auto pg = init_process_group(InitOptions().timeout(collective_timeout()).gloo_interface("lo"));
        EXPECT_EQ(pg->getRank(), r.rank);
        EXPECT_EQ(pg->getSize(), 3);
        EXPECT_EQ(launch_env().launcher, "torchrun");
        auto t = torch::full({2}, static_cast<float>(r.rank + 1));
        fsdp::all_reduce(pg, t);
        EXPECT_TRUE(t.equal(torch::full({2}, 6.0f)));
      },
      opts);
}

// Gloo's transport thread aborts the process on a collective of mismatched size, outside any try
// block; the library's terminate handler says first what happened and what to do.
TEST(GlooAbort, IsExplainedBeforeTheAbort) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        fsdp::detail::explain_gloo_aborts(3);
        std::thread([] {
          throw std::runtime_error(
              "[enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 32 vs 4. Is there a distributed "
              "collective mismatch in your code?");
        }).join();
      },
      "fsdp: Gloo aborts this process \\(rank 3\\).*FSDP_VERIFY_COLLECTIVES=1");
}

}  // namespace
}  // namespace fsdp::testing
