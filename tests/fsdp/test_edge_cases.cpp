// What real training code does around the plain loop: eval forwards, several forwards before one
// backward, unused parameters, misuse (clipping or stepping before backward, calling a block
// around its wrapper). Faults (peers that die or stop) are in test_faults.cpp.
#include "tests/parity.h"

#include <torch/nn/functional/loss.h>

#include <csignal>

namespace fsdp::testing {
namespace {

const gpt::Config kCfg{23, 6, 2, 2, 12, true};

torch::Tensor ce(const torch::Tensor& logits, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(logits.flatten(0, 1), y.flatten());
}

std::pair<torch::Tensor, torch::Tensor> batch(int seed) {
  torch::manual_seed(seed);
  auto tok = torch::randint(kCfg.vocab_size, {kGlobalBatch, kCfg.block_size + 1}, torch::kLong);
  return {tok.narrow(1, 0, kCfg.block_size), tok.narrow(1, 1, kCfg.block_size)};
}

// Evaluation forwards (no grad, eval mode) between training steps leave nothing gathered and no
// hooks behind, and change nothing in training.
TEST(EdgeCases, EvalForwardsBetweenSteps) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    auto ref = gpt::make_gpt<false>(kCfg);
    torch::manual_seed(0);
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
    torch::optim::SGD ref_opt(ref->parameters(), 0.1), opt(model->parameters(), 0.1);
    compare_steps(
        r, ref, model, ref_opt, opt, 3,
        [&](auto forward, auto rows, int step, bool wrapped) {
          if (wrapped) {
            torch::NoGradGuard no_grad;
            model.eval();
            auto [vx, vy] = batch(900 + step);
            torch::Tensor eval_loss = ce(model(rows(vx)), rows(vy));
            EXPECT_TRUE(std::isfinite(eval_loss.item<double>()));
            expect_between_steps(r, model, *ref);  // nothing left gathered by a no-grad forward
            model.train();
          }
          auto [x, y] = batch(100 + step);
          return ce(forward(rows(x)), rows(y));
        },
        [](int) {});
    expect_shards_match(r, model, *ref);
  });
}

// Two forwards, one backward of the summed loss (e.g. two micro-batches, or a contrastive pair).
TEST(EdgeCases, SeveralForwardsBeforeOneBackward) {
  run_ranks(3, [](Rank& r) {
    torch::manual_seed(0);
    auto ref = gpt::make_gpt<false>(kCfg);
    torch::manual_seed(0);
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
    torch::optim::SGD ref_opt(ref->parameters(), 0.1), opt(model->parameters(), 0.1);
    compare_steps(
        r, ref, model, ref_opt, opt, 3,
        [&](auto forward, auto rows, int step, bool /*wrapped*/) {
          auto [x1, y1] = batch(200 + step);
          auto [x2, y2] = batch(300 + step);
          return ce(forward(rows(x1)), rows(y1)) + ce(forward(rows(x2)), rows(y2));
        },
        [&](int) { expect_between_steps(r, model, *ref); });
    expect_shards_match(r, model, *ref);
    // Both forwards' backward ran in the one backward, though the loss (and with it their graphs'
    // hooks) is still held: no step in progress.
    auto [x1, y1] = batch(400);
    auto [x2, y2] = batch(401);
    auto loss = ce(model(x1), y1) + ce(model(x2), y2);
    loss.backward();
    EXPECT_FALSE(model.step_in_progress());
    opt.zero_grad();
  });
}

/// A unit with a branch that this model never uses: its parameters get no gradient, as in plain
/// LibTorch, and the rest trains normally.
template <bool kSharded>
struct WithUnusedImpl : torch::nn::Module {
  struct UnitImpl : torch::nn::Module {
    UnitImpl()
        : used(register_module("used", torch::nn::Linear(4, 6))),
          unused(register_module("unused", torch::nn::Linear(4, 6))) {}
    torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(used(x)); }
    torch::nn::Linear used, unused;
  };
  using Unit = std::conditional_t<kSharded, fsdp::Sharded<UnitImpl>, torch::nn::ModuleHolder<UnitImpl>>;
  WithUnusedImpl() : unit(register_module("unit", Unit())), head(register_module("head", torch::nn::Linear(6, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(unit(x)); }
  Unit unit;
  torch::nn::Linear head;
};

TEST(EdgeCases, UnusedParameters) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(1);
    auto ref = std::make_shared<WithUnusedImpl<false>>();
    torch::manual_seed(1);
    auto model = fsdp::fully_shard(std::make_shared<WithUnusedImpl<true>>(), r.pg, test_options());
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    compare_steps(
        r, ref, model, ref_opt, opt, 3,
        [&](auto forward, auto rows, int step, bool /*wrapped*/) {
          torch::manual_seed(60 + step);
          return forward(rows(torch::randn({kGlobalBatch, 4}))).square().mean();
        },
        [&](int) {
          EXPECT_FALSE(model->named_parameters()["unit.unused.weight"].grad().defined());
          EXPECT_TRUE(model->named_parameters()["unit.used.weight"].grad().defined());
          expect_between_steps(r, model, *ref);
        });
    expect_shards_match(r, model, *ref);
  });
}

TEST(EdgeCases, ClippingOrFusedStepBeforeBackwardIsAnError) {
  run_ranks(2, [](Rank& r) {
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
    auto msg = error_of([&] { fsdp::optim::clip_grad_norm(model, 1.0); });
    EXPECT_NE(msg.find("no sharded parameter has a gradient on any rank"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(rank " + std::to_string(r.rank) + " of 2)"), std::string::npos) << msg;
    fsdp::optim::FusedAdamW opt(model);
    msg = error_of([&] { opt.step(); });
    EXPECT_NE(msg.find("FusedAdamW::step: no sharded parameter has a gradient"), std::string::npos) << msg;
  });
}

// A model whose forward calls a unit's Impl::forward (around its fsdp::Sharded wrapper).
struct CallsImplForwardImpl : torch::nn::Module {
  CallsImplForwardImpl()
      : ln(register_module("ln", fsdp::Sharded<torch::nn::LayerNormImpl>(torch::nn::LayerNormOptions({8})))),
        head(register_module("head", torch::nn::Linear(8, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(ln->torch::nn::LayerNormImpl::forward(x)); }
  fsdp::Sharded<torch::nn::LayerNormImpl> ln;
  torch::nn::Linear head;
};

// The root's own layer first, then a unit called as it should be.
struct RootLayerFirstImpl : torch::nn::Module {
  RootLayerFirstImpl()
      : pre(register_module("pre", torch::nn::Linear(5, 8))),
        ln(register_module("ln", fsdp::Sharded<torch::nn::LayerNormImpl>(torch::nn::LayerNormOptions({8})))) {}
  torch::Tensor forward(const torch::Tensor& x) { return ln(pre(x)); }
  torch::nn::Linear pre;
  fsdp::Sharded<torch::nn::LayerNormImpl> ln;
};

// Calling the model's own forward (model->forward, around the handle) is refused with a hint as
// soon as it reaches a unit; a block's own forward (around its wrapper) between steps finds its
// shards: an error from the first operation that needs the full shape, never a read of freed memory.
// Inside the handle's forward, such an error names the unit that never ran through its wrapper.
TEST(EdgeCases, BlockCalledAroundItsWrapper) {
  run_ranks(2, [](Rank& r) {
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
    auto x = torch::randn({2, kCfg.block_size, kCfg.n_embd});
    gpt::BlockImpl& plain = *model->blocks[0];  // the user's BlockImpl inside the wrapper
    EXPECT_THROW(plain.forward(x), c10::Error);
    // The root's own embeddings fail first here (positions past this rank's rows): the error is
    // the operation's, and a warning names the cause as it leaves the call.
    auto idx = torch::zeros({2, kCfg.block_size}, torch::kLong);
    std::string warned;
    {
      WarningCapture capture;
      EXPECT_FALSE(error_of([&] { model->forward(idx); }).empty());
      warned = capture.text();
    }
    EXPECT_NE(warned.find("model->forward(x)"), std::string::npos) << warned;
    EXPECT_NE(warned.find("call the handle itself: model(x)"), std::string::npos) << warned;
    // A model whose root computes nothing of its own before its first unit reaches the unit's check.
    auto chain = fsdp::fully_shard(std::make_shared<UnevenMLPImpl<true>>(), r.pg, test_options());
    auto msg = error_of([&] { chain->forward(torch::randn({2, 7})); });
    EXPECT_NE(msg.find("such as model->forward(x)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Call the handle itself: model(x)"), std::string::npos) << msg;
    // The handle still works, with nothing left half done by the refused call.
    EXPECT_EQ(model(idx).sizes(), (std::vector<int64_t>{2, kCfg.block_size, kCfg.vocab_size}));
    // The module given to fully_shard, called itself (the program kept its pointer): refused at
    // its first unit, under NoGradGuard too (it would compute on the root's shards).
    auto held = std::make_shared<UnevenMLPImpl<true>>();
    auto wrapped = fsdp::fully_shard(held, r.pg, test_options());
    const auto in = torch::randn({2, 7});
    {
      torch::NoGradGuard no_grad;
      msg = error_of([&] { held->forward(in); });
    }
    EXPECT_NE(msg.find("unit 'fc1' ran its forward outside the wrapped model's forward"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Call the handle itself: model(x)"), std::string::npos) << msg;
    EXPECT_EQ(wrapped(in).sizes(), (std::vector<int64_t>{2, 3}));
    // The model's forward calls ln->LayerNormImpl::forward: LibTorch's error on the shard's shape,
    // with the library's hint naming the unit and the remedy.
    auto direct = fsdp::fully_shard(std::make_shared<CallsImplForwardImpl>(), r.pg, test_options());
    msg = error_of([&] { direct(torch::randn({3, 8})); });
    EXPECT_NE(msg.find("normalized_shape"), std::string::npos) << "LibTorch's own error first\n" << msg;
    EXPECT_NE(msg.find("Unit 'ln' had not run through the fsdp::Sharded wrapper"), std::string::npos) << msg;
    EXPECT_NE(msg.find("call the unit itself (block(x) or block->forward(x))"), std::string::npos) << msg;
    EXPECT_NE(msg.find("names [4], the shape of this rank's shard of 'ln.weight' (full [8]), 'ln.bias' (full [8])"),
              std::string::npos)
        << msg;
    // A wrong input to the root's own layer, before its unit ran: LibTorch's error and the unit
    // named, with no hint about a unit called around its wrapper (none was).
    auto first = fsdp::fully_shard(std::make_shared<RootLayerFirstImpl>(), r.pg, test_options());
    msg = error_of([&] { first(torch::randn({3, 7})); });
    EXPECT_NE(msg.find("cannot be multiplied"), std::string::npos) << "LibTorch's own error first\n" << msg;
    EXPECT_NE(msg.find("raised in the forward of unit"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("had not run through"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("compute in"), std::string::npos) << "no dtype met but the unit's own: " << msg;
  });
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing {
namespace {

/// Two modules of one unit share a weight (tied projections): sharded once, in the optimizer
/// once, equal to plain LibTorch.
struct HalfImpl : torch::nn::Module {
  explicit HalfImpl(const torch::Tensor& w) : weight(register_parameter("weight", w)) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(x.matmul(weight)); }
  torch::Tensor weight;
};
TORCH_MODULE(Half);

struct TiedUnitImpl : torch::nn::Module {
  explicit TiedUnitImpl(const torch::Tensor& w) : a(register_module("a", Half(w))), b(register_module("b", Half(w))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(a(x)); }
  Half a, b;
};

template <bool kSharded>
struct TiedNetImpl : torch::nn::Module {
  using Unit = std::conditional_t<kSharded, fsdp::Sharded<TiedUnitImpl>, torch::nn::ModuleHolder<TiedUnitImpl>>;
  TiedNetImpl() : unit(register_module("unit", Unit(torch::randn({5, 5}) * 0.3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return unit(x).sum(1); }
  Unit unit;
};

TEST(EdgeCases, WeightSharedInsideOneUnit) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(2);
    auto ref = std::make_shared<TiedNetImpl<false>>();
    torch::manual_seed(2);
    auto model = fsdp::fully_shard(std::make_shared<TiedNetImpl<true>>(), r.pg, test_options());
    ASSERT_EQ(model.parameters().size(), 1u);  // one tensor, under two names
    ASSERT_EQ(model.named_parameters().size(), 2u);
    torch::optim::SGD ref_opt({ref->unit->a->weight}, 0.1), opt(model.parameters(), 0.1);
    compare_steps(
        r, ref, model, ref_opt, opt, 3,
        [&](auto forward, auto rows, int step, bool /*wrapped*/) {
          torch::manual_seed(70 + step);
          return forward(rows(torch::randn({kGlobalBatch, 5}))).square().mean();
        },
        [](int) {});
    EXPECT_TRUE(close(model.named_parameters()["unit.b.weight"].detach(),
                      owned_rows(ref->unit->a->weight.detach(), r.rank, r.world_size)));
  });
}

}  // namespace
}  // namespace fsdp::testing
