// Activation checkpointing of FSDP units: with dropout, every strategy, fp32 and bf16, with and
// without accumulation, checkpointing every unit and every 2nd unit gives the losses, gradients
// and parameters of the run without it, bit for bit, at the same world size, with the same
// collectives (counts and volume); without dropout it keeps parity with plain LibTorch using the
// same checkpoint call; with CPU offload; a frozen embedding (the first unit's input needs no gradient), a unit with
// two outputs, eval and no-grad forwards; a second backward refused; and the memory it saves.
// Each world size is one launch that runs every case.
#include "tests/parity.h"

#include <torch/torch.h>

namespace fsdp::testing {
namespace {

constexpr auto kFull = ShardingStrategy::kFullShard;

struct Case {
  ShardingStrategy strategy;
  bool bf16 = false;
  int micro = 1;           // micro-batches per step
  bool sync_every = true;  // with micro > 1: reduce every micro-batch, or only the last
  bool frozen_embedding = false;
  bool offload = false;  // CPUOffloadPolicy through the CPU test seam (FSDP_TEST_OFFLOAD_ON_CPU=1)
};

std::string describe(const Case& c, int every) {
  std::ostringstream os;
  os << to_string(c.strategy) << (c.bf16 ? " bf16" : " fp32") << ", " << c.micro << " micro-batches"
     << (c.micro > 1 ? (c.sync_every ? " (sync every)" : " (sync last)") : "")
     << (c.frozen_embedding ? ", frozen embedding" : "") << (c.offload ? ", offload" : "") << ", checkpoint every "
     << every;
  return os.str();
}

const gpt::Config kConfig{29, 8, 4, 2, 12, true, /*dropout=*/0.1};

struct Trace {
  std::vector<at::Tensor> losses, grads, params;
  std::vector<CommStats> comm;
};

Trace train(Rank& r, const Case& c, int every) {
  auto options =
      test_options(c.strategy, c.strategy == ShardingStrategy::kHybridShard ? (r.world_size % 2 == 0 ? 2 : 1) : 0)
          .activation_checkpointing_every(every);
  // bf16: compute in bf16 where the strategy gathers from shards; ZeRO-1 and replicated units
  // keep full parameters and take a bf16 reduction only.
  const bool gathers = traits(c.strategy).params_sharded;
  if (c.bf16) {
    options.mixed_precision(gathers ? MixedPrecisionPolicy().param_dtype(torch::kBFloat16)
                                    : MixedPrecisionPolicy().reduce_dtype(torch::kBFloat16));
  }
  if (c.offload) options.offload_policy(CPUOffloadPolicy());
  torch::manual_seed(0);
  auto net = gpt::make_gpt<true>(kConfig);
  if (c.frozen_embedding) {
    net->wte.ptr()->named_parameters()["weight"].requires_grad_(false);
    net->wpe->weight.requires_grad_(false);
  }
  auto model = fsdp::fully_shard(net, r.pg, options);
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
  Trace t;
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    model.reset_comm_stats();
    for (int m = 0; m < c.micro; ++m) {
      model.set_requires_gradient_sync(c.sync_every || m == c.micro - 1);
      auto [x, y] = gpt_batch(kConfig, 900 + 10 * step + m);
      torch::manual_seed(1000 + 100 * step + 10 * m + r.rank);  // dropout: per rank and micro-batch
      auto loss = gpt_loss(model(local_rows(x, r.rank, r.world_size)), local_rows(y, r.rank, r.world_size));
      (loss / c.micro).backward();
      t.losses.push_back(loss.detach());
    }
    t.comm.push_back(model.comm_stats());
    for (const auto& p : model.parameters()) t.grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    opt.step();
  }
  for (const auto& p : model.parameters()) t.params.push_back(p.detach().clone());
  return t;
}

void expect_same_tensors(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const std::string& what,
                         const std::string& label) {
  ASSERT_EQ(a.size(), b.size()) << label;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << label << ": " << what << " " << i;
    if (a[i].defined()) EXPECT_TRUE(torch::equal(a[i], b[i])) << label << ": " << what << " " << i << " differs";
  }
}

void check_bit_exact(Rank& r, const Case& c) {
  const Trace off = train(r, c, 0);
  for (int every : {1, 2}) {
    const std::string label = "rank " + std::to_string(r.rank) + ", " + describe(c, every);
    const Trace on = train(r, c, every);
    expect_same_tensors(on.losses, off.losses, "loss", label);
    expect_same_tensors(on.grads, off.grads, "gradient", label);
    expect_same_tensors(on.params, off.params, "parameter", label);
    for (size_t s = 0; s < off.comm.size(); ++s) {
      EXPECT_EQ(on.comm[s].all_gathers, off.comm[s].all_gathers) << label << ", step " << s;
      EXPECT_EQ(on.comm[s].reduce_scatters, off.comm[s].reduce_scatters) << label << ", step " << s;
      EXPECT_EQ(on.comm[s].all_reduces, off.comm[s].all_reduces) << label << ", step " << s;
      EXPECT_EQ(on.comm[s].elements, off.comm[s].elements) << label << ", step " << s;
      if (c.strategy == kFull && c.micro == 1) {
        // From shapes: the root gathers once (kept for its backward), each block twice (forward,
        // then once for its recompute and backward together); each unit reduce-scatters once.
        EXPECT_EQ(on.comm[s].all_gathers, 1 + 2 * kConfig.n_layer) << label;
        EXPECT_EQ(on.comm[s].reduce_scatters, 1 + kConfig.n_layer) << label;
      }
    }
  }
}

// A unit returning two tensors, the second one used by the next unit only through the loss.
struct TwoOutImpl : torch::nn::Module {
  TwoOutImpl() : fc(register_module("fc", torch::nn::Linear(6, 6))) {}
  std::tuple<at::Tensor, at::Tensor, int64_t> forward(const at::Tensor& x) {
    auto h = torch::dropout(torch::tanh(fc(x)), 0.25, is_training());
    return {h, h.pow(2).sum(-1), x.size(0)};
  }
  torch::nn::Linear fc;
};
struct TwoOutNetImpl : torch::nn::Module {
  TwoOutNetImpl()
      : a(register_module("a", fsdp::Sharded<TwoOutImpl>())), b(register_module("b", fsdp::Sharded<TwoOutImpl>())) {}
  at::Tensor forward(const at::Tensor& x) {
    auto [h1, s1, n1] = a(x);
    auto [h2, s2, n2] = b(h1);
    return h2.sum() + s1.sum() * 0.5 + s2.sum() * static_cast<double>(n1 + n2);
  }
  fsdp::Sharded<TwoOutImpl> a, b;
};

void check_two_outputs_eval_and_refusal(Rank& r) {
  auto run = [&](bool ckpt) {
    torch::manual_seed(4);
    auto net = std::make_shared<TwoOutNetImpl>();
    if (ckpt) net->a->set_activation_checkpointing(true);
    auto model = fsdp::fully_shard(net, r.pg, test_options());
    torch::manual_seed(40 + r.rank);
    auto x = torch::randn({4, 6});
    model(x).backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : model.parameters()) grads.push_back(p.grad().clone());
    // Eval under NoGradGuard: the plain forward, nothing recorded or recomputed.
    model->eval();
    torch::NoGradGuard no_grad;
    grads.push_back(model(x));
    return grads;
  };
  expect_same_tensors(run(true), run(false), "gradient or eval output", "two outputs, rank " + std::to_string(r.rank));

  // A second backward through a wrapped model (retain_graph) is refused on every rank, naming the
  // unit whose output's hook met it first (the root's: the loss is its output), with or without
  // checkpointing (LibTorch alone would fail on the freed parameters' storage).
  for (bool ckpt : {true, false}) {
    torch::manual_seed(4);
    auto net = std::make_shared<TwoOutNetImpl>();
    net->b->set_activation_checkpointing(ckpt);
    auto model = fsdp::fully_shard(net, r.pg, test_options());
    auto loss = model(torch::randn({4, 6}));
    loss.backward({}, /*retain_graph=*/true);
    try {
      loss.backward();
      ADD_FAILURE() << "a second backward was not refused";
    } catch (const fsdp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("a second backward through the forward of unit '<root>'"), std::string::npos)
          << e.what();
    }
  }
}

void check_refusals(Rank& r) {
  // A unit called inside fsdp::activation_checkpoint: refused when its recompute runs.
  struct Net : torch::nn::Module {
    Net() : a(register_module("a", fsdp::Sharded<TwoOutImpl>())) {}
    at::Tensor forward(const at::Tensor& x) {
      auto a_ = a;
      return std::get<0>(fsdp::activation_checkpoint([a_](const at::Tensor& in) mutable { return a_(in); }, x)).sum();
    }
    fsdp::Sharded<TwoOutImpl> a;
  };
  auto model = fsdp::fully_shard(std::make_shared<Net>(), r.pg, test_options());
  auto loss = model(torch::randn({2, 6}));
  try {
    loss.backward();
    ADD_FAILURE() << "a unit inside fsdp::activation_checkpoint was not refused";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be called inside fsdp::activation_checkpoint"), std::string::npos)
        << e.what();
  }
  // A checkpointed unit whose output is a struct (its tensors unseen): refused in its forward.
  struct Out {
    at::Tensor y;
  };
  struct StructOutImpl : torch::nn::Module {
    StructOutImpl() : fc(register_module("fc", torch::nn::Linear(6, 6))) {}
    Out forward(const at::Tensor& x) { return {fc(x)}; }
    torch::nn::Linear fc;
  };
  struct StructNet : torch::nn::Module {
    StructNet() : u(register_module("u", fsdp::Sharded<StructOutImpl>())) {}
    at::Tensor forward(const at::Tensor& x) { return u(x).y.sum(); }
    fsdp::Sharded<StructOutImpl> u;
  };
  auto struct_net = std::make_shared<StructNet>();
  struct_net->u->set_activation_checkpointing(true);
  auto struct_model = fsdp::fully_shard(struct_net, r.pg, test_options());
  try {
    struct_model(torch::randn({2, 6}));
    ADD_FAILURE() << "a checkpointed unit returning a struct was not refused";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unit 'u' is checkpointed but its forward returns a type whose tensors"),
              std::string::npos)
        << e.what();
  }
  // A unit containing units cannot be checkpointed; a negative k is refused.
  struct Outer : torch::nn::Module {
    Outer() : inner(register_module("inner", fsdp::Sharded<TwoOutImpl>())) {}
    std::tuple<at::Tensor, at::Tensor, int64_t> forward(const at::Tensor& x) { return inner(x); }
    fsdp::Sharded<TwoOutImpl> inner;
  };
  struct Nested : torch::nn::Module {
    Nested() : outer(register_module("outer", fsdp::Sharded<Outer>())) {}
    fsdp::Sharded<Outer> outer;
  };
  auto nested = std::make_shared<Nested>();
  nested->outer->set_activation_checkpointing(true);
  EXPECT_THROW(
      {
        try {
          fsdp::fully_shard(nested, r.pg, test_options());
        } catch (const fsdp::Error& e) {
          EXPECT_NE(std::string(e.what()).find("unit 'outer' has set_activation_checkpointing(true) but contains"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      fsdp::Error);
  EXPECT_THROW(fsdp::fully_shard(std::make_shared<Nested>(), r.pg, test_options().activation_checkpointing_every(-1)),
               fsdp::Error);
}

void run_all(Rank& r) {
  constexpr auto kGradOp = ShardingStrategy::kShardGradOp;
  constexpr auto kZero1 = ShardingStrategy::kShardOptimizerState;
  constexpr auto kDDP = ShardingStrategy::kNoShard;
  constexpr auto kHybrid = ShardingStrategy::kHybridShard;
  for (auto s : {kFull, kGradOp, kZero1, kDDP, kHybrid}) {
    check_bit_exact(r, {s});
    check_bit_exact(r, {s, /*bf16=*/true});
    check_bit_exact(r, {s, false, /*micro=*/2, /*sync_every=*/false});
  }
  check_bit_exact(r, {kFull, true, 2, true});
  check_bit_exact(r, {kFull, false, 1, true, /*frozen_embedding=*/true});
  // Without dropout: parity with plain LibTorch checkpointing the same blocks (SGD with biases, as
  // Parity.GPT: Adam would turn the key bias's zero gradient into noise).
  for (int every : {1, 2}) {
    gpt::Config cfg{37, 8, 3, 2, 18, true};
    cfg.checkpoint_every = every;
    check_gpt_parity(r, Opt::kSGD, 3, cfg, 7700 + every);
  }
  check_two_outputs_eval_and_refusal(r);
  check_refusals(r);
}

// CPU offload (through its CPU seam: the shards and sharded gradients in separate host buffers,
// every copy and pointer switch of the CUDA path), with and without bf16 and accumulation.
TEST(ActivationCheckpointOffload, BitExactAgainstOffWithTheSameCollectives) {
  RunOptions o;
  o.env["FSDP_TEST_OFFLOAD_ON_CPU"] = "1";
  run_ranks(
      2,
      [](Rank& r) {
        check_bit_exact(r, {kFull, false, 1, true, false, /*offload=*/true});
        check_bit_exact(r, {kFull, true, 2, false, false, true});
        check_bit_exact(r, {ShardingStrategy::kShardGradOp, false, 1, true, false, true});
      },
      o);
}

class ActivationCheckpointFSDP : public ::testing::TestWithParam<int> {};
TEST_P(ActivationCheckpointFSDP, EveryStrategyBitExactWithTheSameCollectives) {
  RunOptions o;
  o.timeout = std::chrono::seconds(280);
  run_ranks(GetParam(), run_all, o);
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, ActivationCheckpointFSDP, ::testing::Values(1, 2, 3, 4));

// The bytes one GPT block's backward keeps besides its input, from shapes (fp32, N = B x T rows):
// ln_1's output and statistics, q/k/v (one [N, 3C] tensor), the attention's output [N, C] (SDPA's
// flash kernel keeps it, the same storage c_proj reads) and its log-sum-exp [B, H, T] (no T x T
// weights), the residual sum ln_2 reads, ln_2's output and statistics, the MLP's hidden layer
// before and after GELU [N, 4C].
int64_t block_activation_bytes(const gpt::Config& c, int64_t B) {
  const int64_t T = c.block_size, C = c.n_embd, N = B * T;
  const int64_t floats = N * C + 2 * N             // ln_1: output, mean and rstd
                         + 3 * N * C               // c_attn: q, k, v
                         + B * c.n_head * T        // SDPA's log-sum-exp
                         + N * C                   // attention output, c_proj's input
                         + N * C + N * C + 2 * N   // residual sum (ln_2's input), ln_2's output and statistics
                         + 4 * N * C + 4 * N * C;  // c_fc's output (GELU's input), GELU's output
  return floats * 4;
}

// The peak of one training step, above what was allocated before it (a step ran before, so the
// library's buffers are in place), with and without every block checkpointed.
TEST(ActivationCheckpointMemory, CheckpointingEveryBlockSavesTheOtherBlocksActivations) {
  run_ranks(2, [](Rank& r) {
    fsdp::memory::enable_cpu_counting();
    gpt::Config cfg;  // train_gpt's model
    cfg.block_size = 256;
    const int64_t global_batch = 16, B = global_batch / r.world_size;
    auto step_peak = [&](int every) {
      torch::manual_seed(0);
      auto model =
          fsdp::fully_shard(gpt::make_gpt<true>(cfg), r.pg, test_options().activation_checkpointing_every(every));
      torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
      auto [x, y] = gpt_batch(cfg, 5, global_batch);
      x = local_rows(x, r.rank, r.world_size);
      y = local_rows(y, r.rank, r.world_size);
      int64_t peak = 0;
      for (int step = 0; step < 2; ++step) {
        opt.zero_grad();
        const int64_t before = fsdp::memory::stats().current_bytes;
        fsdp::memory::reset_peak();
        gpt_loss(model(x), y).backward();
        peak = fsdp::memory::stats().peak_bytes - before;
        opt.step();
      }
      return peak;
    };
    const int64_t off = step_peak(0);
    const int64_t on = step_peak(1);
    const int64_t saved_from_shapes = (cfg.n_layer - 1) * block_activation_bytes(cfg, B);
    std::cout << "rank " << r.rank << ": step peak without checkpointing " << off << " bytes, with " << on << " (ratio "
              << static_cast<double>(on) / static_cast<double>(off) << "); (L - 1) blocks' activations "
              << saved_from_shapes << " bytes" << std::endl;
    EXPECT_GE(off - on, saved_from_shapes * 9 / 10) << "off " << off << ", on " << on;
  });
}

}  // namespace
}  // namespace fsdp::testing
