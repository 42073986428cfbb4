// The models the tensor-parallel FSDP tests train: a small transformer-like net of fsdp::tp layers
// in fsdp::Sharded blocks (TPNet), the same net of plain LibTorch layers built from the same random
// draws (PlainNet), the batches, and the plain net's reference run in one process.
#pragma once

#include "fsdp/fsdp.h"

#include <torch/torch.h>

#include <utility>
#include <vector>

namespace fsdp::testing {

constexpr int64_t kV = 32, kC = 16, kH = 32, kSeq = 8, kBatch = 12, kLayers = 2;

// A block: pre-norm MLP with a residual. The norm's weight is replicated over the tensor-parallel
// ranks (clipping must count it once), the MLP's weights split.
struct TPBlockImpl : torch::nn::Module {
  explicit TPBlockImpl(const tp::Group& g)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kC})))),
        up(register_module("up", tp::ColumnParallelLinear(g, tp::ColumnParallelLinearOptions(kC, kH)))),
        down(register_module("down", tp::RowParallelLinear(g, tp::RowParallelLinearOptions(kH, kC)))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + down(torch::gelu(up(ln(x)))); }
  torch::nn::LayerNorm ln;
  tp::ColumnParallelLinear up;
  tp::RowParallelLinear down;
};

struct TPNetImpl : torch::nn::Module {
  TPNetImpl(const tp::Group& blocks, const tp::Group& vocab)
      : emb(register_module("emb", tp::VocabParallelEmbedding(vocab, tp::VocabParallelEmbeddingOptions(kV, kC)))),
        vocab(vocab) {
    for (int i = 0; i < kLayers; ++i)
      h.push_back(register_module("h" + std::to_string(i), Sharded<TPBlockImpl>(blocks)));
    lnf = register_module("lnf", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kC})));
    head =
        register_module("head", tp::ColumnParallelLinear(vocab, tp::ColumnParallelLinearOptions(kC, kV).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& targets) {
    auto x = emb(ids);
    for (auto& b : h) x = b(x);
    return tp::vocab_parallel_cross_entropy(head(lnf(x)), targets, vocab);
  }
  tp::VocabParallelEmbedding emb;
  std::vector<Sharded<TPBlockImpl>> h;
  torch::nn::LayerNorm lnf{nullptr};
  tp::ColumnParallelLinear head{nullptr};
  tp::Group vocab;
};
TORCH_MODULE(TPNet);

// The same model of plain layers, built in the same order (so from the same random draws).
struct PlainBlockImpl : torch::nn::Module {
  PlainBlockImpl()
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kC})))),
        up(register_module("up", torch::nn::Linear(kC, kH))),
        down(register_module("down", torch::nn::Linear(kH, kC))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + down(torch::gelu(up(ln(x)))); }
  torch::nn::LayerNorm ln;
  torch::nn::Linear up, down;
};
TORCH_MODULE(PlainBlock);

struct PlainNetImpl : torch::nn::Module {
  PlainNetImpl() : emb(register_module("emb", torch::nn::Embedding(kV, kC))) {
    for (int i = 0; i < kLayers; ++i) h.push_back(register_module("h" + std::to_string(i), PlainBlock()));
    lnf = register_module("lnf", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kC})));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(kC, kV).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& targets) {
    auto x = emb(ids);
    for (auto& b : h) x = b(x);
    return torch::nn::functional::cross_entropy(head(lnf(x)).view({-1, kV}), targets.view({-1}));
  }
  torch::nn::Embedding emb;
  std::vector<PlainBlock> h;
  torch::nn::LayerNorm lnf{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(PlainNet);

inline std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(500 + step);
  return {torch::randint(kV, {kBatch, kSeq}), torch::randint(kV, {kBatch, kSeq})};
}

constexpr int kSteps = 5;
constexpr double kMaxNorm = 0.5;  // below the first steps' norms: clipping is active

struct Trace {
  std::vector<double> losses, norms;
};

inline Trace train_plain(PlainNet& net) {
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  Trace t;
  for (int s = 0; s < kSteps; ++s) {
    auto [ids, targets] = batch(s);
    auto loss = net->forward(ids, targets);
    loss.backward();
    t.norms.push_back(torch::nn::utils::clip_grad_norm_(net->parameters(), kMaxNorm));
    opt.step();
    opt.zero_grad();
    t.losses.push_back(loss.item<double>());
  }
  return t;
}

// This rank's tensor-parallel part of the plain net's `full` tensor for parameter `s` (all of it
// when tensor parallelism does not split it).
inline torch::Tensor part_of(const torch::Tensor& full, const ShardSpec& s) {
  if (!s.tp.split()) return full;
  const int64_t n = full.size(s.tp.dim) / s.tp.parts;
  return full.narrow(s.tp.dim, s.tp.part * n, n);
}

// One step of the tensor-parallel model on this data-parallel rank's rows of batch `step`: the
// loss averaged over the data-parallel ranks, and the clipped norm.
inline std::pair<double, double> tp_step(FullyShardedModule<TPNetImpl>& model, torch::optim::Optimizer& opt,
                                         const DeviceMesh& mesh, int step) {
  const int dp = mesh.size(kDataDim), me = mesh.coordinate(kDataDim);
  auto [ids, targets] = batch(step);
  const int64_t rows = kBatch / dp;  // this data-parallel rank's sequences
  auto loss = model(ids.narrow(0, me * rows, rows), targets.narrow(0, me * rows, rows));
  loss.backward();
  const double norm = optim::clip_grad_norm(model, kMaxNorm);
  opt.step();
  opt.zero_grad();
  at::Tensor mean = loss.detach().clone();
  fsdp::all_reduce(mesh.group(kDataDim), mean);
  return {mean.item<double>() / dp, norm};
}

}  // namespace fsdp::testing
