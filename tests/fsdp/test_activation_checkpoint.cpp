// fsdp::activation_checkpoint without FSDP: the same gradients, bit for bit, as the forward run
// plainly (dropout included: the recompute draws the same numbers), the random state after the
// step unchanged, inputs that need no gradient, several outputs and non-tensor arguments, no
// recompute without gradients, and what it refuses.
#include "fsdp/activation_checkpoint.h"
#include "fsdp/error.h"
#include "tests/models.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <array>

namespace fsdp::testing {
namespace {

// A block with dropout inside and a parameter used twice.
struct DropBlockImpl : torch::nn::Module {
  DropBlockImpl()
      : fc1(register_module("fc1", torch::nn::Linear(6, 10))), fc2(register_module("fc2", torch::nn::Linear(10, 6))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::dropout(torch::gelu(fc1(x)), 0.3, is_training());
    return x + torch::dropout(fc2(h), 0.2, is_training());
  }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(DropBlock);

struct StepResult {
  at::Tensor loss, x_grad, next_draw;
  std::vector<at::Tensor> grads;
};

// Two blocks, the second (or both) checkpointed; the loss, every gradient, and the next random number.
StepResult run_blocks(bool checkpoint_first, bool checkpoint_second, bool input_grad) {
  torch::manual_seed(3);
  DropBlock a, b;
  auto x = torch::randn({5, 6}).requires_grad_(input_grad);
  torch::manual_seed(11);
  auto call = [](DropBlock m, const at::Tensor& in, bool ckpt) {
    return ckpt ? fsdp::activation_checkpoint([m](const at::Tensor& t) mutable { return m(t); }, in) : m(in);
  };
  auto y = call(b, call(a, x, checkpoint_first), checkpoint_second);
  auto loss = (y * y).sum();
  loss.backward();
  StepResult r{loss.detach(), input_grad ? x.grad() : at::Tensor(), torch::rand({4}), {}};
  for (auto* m : {&a, &b}) {
    for (const auto& p : (*m)->parameters()) r.grads.push_back(p.grad());
  }
  return r;
}

void expect_same(const StepResult& a, const StepResult& b) {
  EXPECT_TRUE(torch::equal(a.loss, b.loss));
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    ASSERT_TRUE(a.grads[i].defined() && b.grads[i].defined()) << "gradient " << i;
    EXPECT_TRUE(torch::equal(a.grads[i], b.grads[i])) << "gradient " << i;
  }
  EXPECT_EQ(a.x_grad.defined(), b.x_grad.defined());
  if (a.x_grad.defined()) EXPECT_TRUE(torch::equal(a.x_grad, b.x_grad));
  // The recompute put back the generator: later draws are the ones without it.
  EXPECT_TRUE(torch::equal(a.next_draw, b.next_draw));
}

TEST(ActivationCheckpoint, DropoutGradientsAreBitExact) {
  const StepResult plain = run_blocks(false, false, true);
  expect_same(run_blocks(true, true, true), plain);
  expect_same(run_blocks(false, true, true), plain);
  expect_same(run_blocks(true, false, true), plain);
}

TEST(ActivationCheckpoint, NoInputNeedsAGradient) {
  // The first block after a frozen embedding: only the parameters need gradients.
  const StepResult plain = run_blocks(false, false, false);
  expect_same(run_blocks(true, true, false), plain);
}

TEST(ActivationCheckpoint, SeveralOutputsAndNonTensorArguments) {
  torch::manual_seed(5);
  torch::nn::Linear fc(4, 4);
  auto x = torch::randn({3, 4}).requires_grad_();
  auto w = torch::randn({4}).requires_grad_();
  std::vector<at::Tensor> extra{torch::randn({3, 4}).requires_grad_(), torch::randn({3, 4})};
  std::optional<at::Tensor> shift = torch::randn({4}).requires_grad_();
  int calls = 0;
  auto fn = [fc, &calls](const at::Tensor& in, double scale, const std::vector<at::Tensor>& more,
                         const std::optional<at::Tensor>& s, int64_t k) mutable {
    ++calls;
    auto h = torch::tanh(fc(in + more[0] * more[1])) * scale + *s;
    return std::make_tuple(h, h.sum(1) * static_cast<double>(k), k + 1, std::string("kept"));
  };
  auto loss_of = [&](const auto& out) {
    return (std::get<0>(out) * std::get<0>(out)).sum() + std::get<1>(out).pow(2).sum();
  };
  auto params = [&] {
    std::vector<at::Tensor> ps{x, w, extra[0], *shift};
    for (const auto& p : fc->parameters()) ps.push_back(p);
    return ps;
  };
  auto out = fn(x * w, 0.5, extra, shift, 3);
  loss_of(out).backward();
  std::vector<at::Tensor> plain;
  for (auto& p : params()) {
    plain.push_back(p.grad().clone());
    p.mutable_grad() = at::Tensor();
  }
  calls = 0;
  auto ck = fsdp::activation_checkpoint(fn, x * w, 0.5, extra, shift, int64_t{3});
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(std::get<2>(ck), 4);
  EXPECT_EQ(std::get<3>(ck), "kept");
  EXPECT_FALSE(std::get<0>(ck).grad_fn() == nullptr);
  loss_of(ck).backward();
  EXPECT_EQ(calls, 2);  // once in forward, once in backward
  const auto ps = params();
  for (size_t i = 0; i < ps.size(); ++i) {
    ASSERT_TRUE(ps[i].grad().defined()) << "tensor " << i;
    EXPECT_TRUE(torch::equal(ps[i].grad(), plain[i])) << "tensor " << i;
  }
  EXPECT_FALSE(extra[1].grad().defined());
}

TEST(ActivationCheckpoint, NoGradAndEvalDoNotRecompute) {
  torch::nn::Linear fc(3, 3);
  int calls = 0;
  auto fn = [fc, &calls](const at::Tensor& in) mutable {
    ++calls;
    return fc(in);
  };
  {
    torch::NoGradGuard no_grad;
    auto y = fsdp::activation_checkpoint(fn, torch::randn({2, 3}));
    EXPECT_FALSE(y.requires_grad());
  }
  EXPECT_EQ(calls, 1);
  // Accumulation over two micro-batches, and zero_grad between steps, as without the checkpoint.
  auto x1 = torch::randn({2, 3}), x2 = torch::randn({2, 3});
  fc(x1).sum().backward();
  fc(x2).sum().backward();
  const at::Tensor plain = fc->weight.grad().clone();
  fc->zero_grad();
  EXPECT_FALSE(fc->weight.grad().defined());
  calls = 0;
  fsdp::activation_checkpoint(fn, x1).sum().backward();
  fsdp::activation_checkpoint(fn, x2).sum().backward();
  EXPECT_EQ(calls, 4);
  EXPECT_TRUE(torch::allclose(fc->weight.grad(), plain, 0, 0));
}

// The outputs the checkpoint accepts: what its walk over tensors sees entirely. A struct holding
// tensors is refused at compile time (its tensors would come back without gradients).
struct Holder {
  at::Tensor h;
};
static_assert(detail::is_tensor_tree<std::tuple<at::Tensor, std::vector<at::Tensor>, int64_t, std::string>>::value);
static_assert(detail::is_tensor_tree<std::pair<std::optional<at::Tensor>, double>>::value);
static_assert(!detail::is_tensor_tree<Holder>::value);
static_assert(!detail::is_tensor_tree<std::pair<at::Tensor, Holder>>::value);
static_assert(!detail::is_tensor_tree<std::vector<std::vector<at::Tensor>>>::value);
static_assert(!detail::is_tensor_tree<std::array<at::Tensor, 2>>::value);

TEST(ActivationCheckpoint, RefusesWhatItCannotDo) {
  torch::nn::Linear fc(3, 3);
  auto fn = [fc](const at::Tensor& in) mutable { return torch::tanh(fc(in)); };
  auto x = torch::randn({2, 3}).requires_grad_();
  auto expect_refused = [](const std::function<void()>& f, const std::string& what) {
    try {
      f();
      ADD_FAILURE() << "not refused: " << what;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  // A second backward (retain_graph): refused by the checkpoint, naming the cause.
  auto y = fsdp::activation_checkpoint(fn, x).sum();
  y.backward({}, /*retain_graph=*/true);
  expect_refused([&] { y.backward(); }, "a second backward through a checkpointed forward");
  // torch::autograd::grad over it.
  auto z = fsdp::activation_checkpoint(fn, x).sum();
  expect_refused([&] { torch::autograd::grad({z}, {x}); }, "torch::autograd::grad");
  // An input written in place between forward and backward: LibTorch's version check.
  auto in = torch::randn({2, 3}).requires_grad_();
  auto h = in * 1.0;
  auto out = fsdp::activation_checkpoint(fn, h).sum();
  {
    torch::NoGradGuard no_grad;
    h.add_(1);
  }
  expect_refused([&] { out.backward(); }, "modified by an inplace operation");
  // A function that returns another shape when run again.
  int calls = 0;
  auto unstable = [fc, &calls](const at::Tensor& t) mutable { return ++calls == 1 ? fc(t) : fc(t).narrow(0, 0, 1); };
  auto u = fsdp::activation_checkpoint(unstable, x).sum();
  expect_refused([&] { u.backward(); }, "the recompute in backward returned");
}

}  // namespace
}  // namespace fsdp::testing
