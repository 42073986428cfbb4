// Zero bubble's split backward (pp/split_backward.h): the input pass then the weight pass give the
// gradients of one backward, at the input and at every weight; W starts from the nodes where the
// weights meet the input path, so the activation gradients are not computed again (a hook on an
// activation fires once over I and W); a weight used twice along the path runs W from the output
// instead; a stage whose input takes no gradient (the first) does the whole backward in I; a Llama
// stage's weights all run from their nodes.
#include "examples/llama/pipelined.h"
#include "fsdp/fsdp.h"
#include "tests/harness.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>

namespace fsdp::testing {
namespace {

using Forward = std::function<torch::Tensor(const torch::Tensor& x, const std::vector<torch::Tensor>& w)>;

// One backward over copies of `weights` and `x`, against I then W over the originals.
void check_split(const Forward& f, const torch::Tensor& x0, const std::vector<torch::Tensor>& weights0,
                 int64_t from_nodes, int64_t from_output, const std::string& label) {
  auto copies = [&] {
    std::vector<torch::Tensor> w;
    for (const auto& t : weights0) w.push_back(t.detach().clone().requires_grad_(true));
    return w;
  };
  const bool input_grad = x0.is_floating_point();
  auto leaf = [&] { return input_grad ? x0.detach().clone().requires_grad_(true) : x0; };
  const auto ref_w = copies();
  const auto ref_x = leaf();
  const auto ref_out = f(ref_x, ref_w);
  torch::manual_seed(3);
  const auto grad_out = torch::randn_like(ref_out);
  ref_out.backward(grad_out);

  const auto w = copies();
  const auto x = leaf();
  const auto out = f(x, w);
  torch::Tensor grad_in;
  auto pass = pp::backward_input(out, grad_out, input_grad ? x : torch::Tensor(), w, grad_in);
  EXPECT_EQ(pass.groups_from_nodes(), from_nodes) << label;
  EXPECT_EQ(pass.groups_from_output(), from_output) << label;
  if (input_grad) {
    ASSERT_TRUE(grad_in.defined()) << label;
    EXPECT_TRUE(torch::allclose(grad_in, ref_x.grad(), 1e-6, 1e-7)) << label << ": the gradient at the input";
  } else {
    EXPECT_FALSE(grad_in.defined()) << label;
  }
  // The first stage's I is its whole backward; elsewhere no weight has a gradient before W.
  for (const auto& t : w) EXPECT_EQ(t.grad().defined(), !input_grad) << label;
  pass.run();
  for (size_t i = 0; i < w.size(); ++i) {
    ASSERT_TRUE(w[i].grad().defined()) << label << ": weight " << i;
    EXPECT_TRUE(torch::allclose(w[i].grad(), ref_w[i].grad(), 1e-6, 1e-7)) << label << ": weight " << i;
    EXPECT_EQ(w[i].grad().sizes(), w[i].sizes()) << label;
  }
  EXPECT_THROW(pass.run(), c10::Error) << label << ": W runs once";
}

TEST(SplitBackward, InputThenWeightGiveOneBackwardsGradients) {
  torch::manual_seed(1);
  const auto x = torch::randn({4, 8});
  // A linear layer with a bias (one node takes both: one group), a norm-like scale, a second linear.
  int64_t fired = 0;
  const Forward f = [&](const torch::Tensor& in, const std::vector<torch::Tensor>& w) {
    auto h = torch::relu(torch::nn::functional::linear(in, w[0], w[1]));
    if (h.requires_grad()) {
      h.register_hook([&](const torch::Tensor& g) {
        ++fired;
        return g;
      });
    }
    return torch::nn::functional::linear(h * w[2], w[3]);
  };
  const std::vector<torch::Tensor> weights{torch::randn({16, 8}), torch::randn({16}), torch::randn({16}),
                                           torch::randn({8, 16})};
  check_split(f, x, weights, 3, 0, "two linears and a scale");
  // Once in the reference backward and once in I: W does not reach the activation again.
  EXPECT_EQ(fired, 2);
}

TEST(SplitBackward, AWeightUsedTwiceAlongThePathRunsFromTheOutput) {
  torch::manual_seed(2);
  const Forward f = [](const torch::Tensor& in, const std::vector<torch::Tensor>& w) {
    auto h = torch::tanh(torch::nn::functional::linear(in, w[0]));
    return torch::nn::functional::linear(h, w[0]) * w[1];  // w[0] twice; w[1] on its own
  };
  check_split(f, torch::randn({3, 6}), {torch::randn({6, 6}), torch::randn({6})}, 1, 1, "a weight used twice");
}

TEST(SplitBackward, AStageWhoseInputTakesNoGradientRunsItAllInI) {
  torch::manual_seed(3);
  const Forward f = [](const torch::Tensor& ids, const std::vector<torch::Tensor>& w) {
    return torch::nn::functional::linear(torch::embedding(w[0], ids), w[1]);
  };
  check_split(f, torch::randint(10, {2, 5}), {torch::randn({10, 4}), torch::randn({7, 4})}, 0, 0, "the first stage");
}

TEST(SplitBackward, EveryWeightOfALlamaStageRunsFromItsNodes) {
  run_ranks(1, [](Rank& r) {
    llama::Config c;
    c.vocab_size = 32;
    c.block_size = 8;
    c.n_layer = 3;
    c.n_head = 4;
    c.n_kv_head = 2;
    c.n_embd = 16;
    c.intermediate = 24;
    const tp::Group g(r.pg);
    const pp::StageLayout layout(3);
    // The middle stage, layers only, twice with the same weights (drawn by name).
    llama::PipelinedLlama a(c, g, g, layout, 1, 5), b(c, g, g, layout, 1, 5);
    auto& ma = a.models[0];
    auto& mb = b.models[0];
    torch::manual_seed(4);
    const auto x = torch::randn({2, 6, c.n_embd});
    // The two stages are the copies check_split makes of plain weights.
    const auto ref_x = x.clone().requires_grad_(true);
    const auto ref_out = mb->forward(ref_x);
    const auto grad_out = torch::randn_like(ref_out);
    ref_out.backward(grad_out);
    const auto in = x.clone().requires_grad_(true);
    const auto out = ma->forward(in);
    torch::Tensor grad_in;
    const auto params = ma->parameters();
    auto pass = pp::backward_input(out, grad_out, in, params, grad_in);
    EXPECT_EQ(pass.groups_from_output(), 0) << "every weight meets the input path once";
    EXPECT_EQ(pass.groups_from_nodes(), static_cast<int64_t>(params.size()))
        << "each of the layer's weights alone at its node (7 projections, 2 norms)";
    EXPECT_TRUE(torch::allclose(grad_in, ref_x.grad(), 1e-5, 1e-7));
    pass.run();
    const auto want = mb->named_parameters();
    for (const auto& p : ma->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_TRUE(torch::allclose(p.value().grad(), want[p.key()].grad(), 1e-5, 1e-7)) << p.key();
    }
  });
}

}  // namespace
}  // namespace fsdp::testing
