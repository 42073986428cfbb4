// FSDP over tensor parallelism: a model of fsdp::tp layers in fsdp::Sharded blocks, wrapped over a
// DeviceMesh, trained 5 steps with AdamW and clipping against the same model of plain LibTorch
// layers in one process on the whole batch. Meshes (tp, dp) = (2, 1), (1, 2) [two 2-rank jobs side
// by side in one 4-rank launch], (2, 2), (4, 1), hybrid over a 1-D dp mesh, and hybrid with tensor
// parallelism (dp_replicate 2 x dp_shard 2 x tp 2, 8 ranks). Losses and the clipped norm within
// 1e-5 relative at every step, the final weights (each rank's part) within 1e-5; with activation
// checkpointing and FusedAdamW too, and built in a ShardingScope over the mesh.
#include "fsdp/fsdp.h"
#include "tests/harness.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace fsdp::testing {
namespace {

constexpr int64_t kV = 32, kC = 16, kH = 32, kSeq = 8, kBatch = 4, kLayers = 2;

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

std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(500 + step);
  return {torch::randint(kV, {kBatch, kSeq}), torch::randint(kV, {kBatch, kSeq})};
}

constexpr int kSteps = 5;
constexpr double kMaxNorm = 0.5;  // below the first steps' norms: clipping is active

struct Trace {
  std::vector<double> losses, norms;
};

Trace train_plain(PlainNet& net) {
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

// Trains the tensor-parallel model over `mesh` and compares it with the plain one.
void check_mesh(const DeviceMesh& mesh, const FullyShardOptions& options = {}, bool fused = false,
                bool built_sharded = false) {
  // bf16 compute (fp32 master weights and reduction) against the fp32 plain model: bf16 keeps 8
  // bits of mantissa (relative rounding 2^-9 per operation), so the loss and norm agree to 2e-2;
  // fp32 to 1e-5. The weights are compared in fp32 only: AdamW normalizes each gradient element,
  // so one whose gradient is near zero moves by up to the learning rate either way on rounding.
  const bool bf16 = options.mixed_precision().param_dtype() == at::kBFloat16;
  const double tol = bf16 ? 2e-2 : 1e-5;
  const std::string label = "mesh " + mesh.shape_text() + " at " + mesh.coordinates_text() + (bf16 ? ", bf16" : "") +
                            (options.activation_checkpointing_every() > 0 ? ", activation checkpointing" : "") +
                            (fused ? ", FusedAdamW" : "") + (built_sharded ? ", built in a ShardingScope" : "");
  torch::manual_seed(3);
  PlainNet plain;
  const Trace want = train_plain(plain);

  tp::Group blocks(mesh), vocab(mesh);
  torch::manual_seed(3);
  // Built in a ShardingScope over the mesh, each block is sharded (its parts over dp_shard) as
  // soon as it is built; the same weights either way.
  auto model = built_sharded ? [&] {
    ShardingScope scope(mesh, options);
    return fully_shard(TPNet(blocks, vocab), scope);
  }()
                             : fully_shard(TPNet(blocks, vocab), mesh, options);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (fused) {
    opt = std::make_unique<optim::FusedAdamW>(model, torch::optim::AdamWOptions(1e-2));
  } else {
    opt = std::make_unique<torch::optim::AdamW>(model.parameters(), torch::optim::AdamWOptions(1e-2));
  }
  const int dp = mesh.size(kDataDim), me = mesh.coordinate(kDataDim);
  for (int s = 0; s < kSteps; ++s) {
    auto [ids, targets] = batch(s);
    const int64_t rows = kBatch / dp;  // this data-parallel rank's sequences
    auto loss = model(ids.narrow(0, me * rows, rows), targets.narrow(0, me * rows, rows));
    loss.backward();
    const double norm = optim::clip_grad_norm(model, kMaxNorm);
    opt->step();
    opt->zero_grad();
    at::Tensor mean = loss.detach().clone();
    fsdp::all_reduce(mesh.group(kDataDim), mean);
    const double got = mean.item<double>() / dp;
    EXPECT_NEAR(got, want.losses[s], tol * std::abs(want.losses[s])) << label << ", step " << s;
    EXPECT_NEAR(norm, want.norms[s], tol * want.norms[s]) << label << ", step " << s;
  }
  int64_t psi = 0;  // Ψ of the whole model, every part counted
  for (const auto& p : plain->parameters()) psi += p.numel();
  EXPECT_EQ(model.num_parameters(), psi) << label;
  // The weights: this rank's tensor-parallel part of the plain model's, for every parameter.
  const auto specs = model.shard_specs();
  const auto full = model.full_state_dict();
  const auto ref = plain->named_parameters();
  for (const ShardSpec& s : specs) {
    EXPECT_EQ(s.tp_size, mesh.size(kTensorDim)) << s.name;
    torch::Tensor r = ref[s.name];
    if (s.tp.split()) {
      const int64_t n = r.size(s.tp.dim) / s.tp.parts;
      r = r.narrow(s.tp.dim, s.tp.part * n, n);
    }
    ASSERT_EQ(full[s.name].sizes(), r.sizes()) << label << ": " << s.name;
    if (bf16) continue;
    const double err = (full[s.name] - r).abs().max().item<double>();
    EXPECT_LE(err, 1e-5) << label << ": " << s.name;
  }
  // The splits the shard contract reports: the layers' own.
  for (const ShardSpec& s : specs) {
    const bool split = s.name.find("up.") != std::string::npos || s.name.find("down.weight") != std::string::npos ||
                       s.name == "emb.weight" || s.name == "head.weight";
    EXPECT_EQ(s.tp.split(), split && mesh.size(kTensorDim) > 1) << s.name;
  }
}

TEST(TensorParallelFSDP, TrainsAsOneProcessOnEveryMesh) {
  run_ranks(4, [](Rank& r) {
    {
      // Two 2-rank jobs side by side: ranks 0-1 as TP 2, ranks 2-3 as FSDP 2.
      const int half = r.rank / 2;
      auto world2 = new_subgroup(r.pg, {2 * half, 2 * half + 1}, "half" + std::to_string(half));
      check_mesh(DeviceMesh(world2, {{half == 0 ? kTensorDim : kShardDim, 2}}));
    }
    check_mesh(DeviceMesh(r.pg, {{kShardDim, 2}, {kTensorDim, 2}}));
    check_mesh(DeviceMesh(r.pg, {{kTensorDim, 4}}));
    check_mesh(DeviceMesh(r.pg, {{kReplicateDim, 2}, {kShardDim, 2}}));  // hybrid as the mesh's 2-D case
    // Activation checkpointing (the blocks' forwards, collectives included, run again in backward)
    // and the fused optimizer, over FSDP 2 x TP 2.
    check_mesh(DeviceMesh(r.pg, {{kShardDim, 2}, {kTensorDim, 2}}),
               FullyShardOptions().activation_checkpointing_every(1),
               /*fused=*/true);
    check_mesh(DeviceMesh(r.pg, {{kShardDim, 2}, {kTensorDim, 2}}), {}, false, /*built_sharded=*/true);
    check_mesh(DeviceMesh(r.pg, {{kShardDim, 2}, {kTensorDim, 2}}),
               FullyShardOptions().mixed_precision(
                   MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat)));

    // Refused: tensor-parallel layers wrapped over the world (sharding would mix the parts), and a
    // strategy a 2-D data-parallel mesh cannot mean.
    DeviceMesh mesh(r.pg, {{kShardDim, 2}, {kTensorDim, 2}});
    tp::Group g(mesh);
    std::string e;
    try {
      fully_shard(TPNet(g, g), r.pg);
    } catch (const std::exception& x) {
      e = x.what();
    }
    EXPECT_NE(e.find("module 'emb' is tensor parallel over global ranks " + std::to_string(r.rank / 2 * 2) + ", " +
                     std::to_string(r.rank / 2 * 2 + 1)),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("fsdp::fully_shard(model, mesh)"), std::string::npos) << e;
    e.clear();
    try {
      fully_shard(TPNet(g, g), DeviceMesh(r.pg, {{kReplicateDim, 2}, {kShardDim, 2}}),
                  FullyShardOptions().strategy(ShardingStrategy::kNoShard));
    } catch (const std::exception& x) {
      e = x.what();
    }
    EXPECT_NE(e.find("means hybrid sharding, but the options ask for no-shard"), std::string::npos) << e;
    // A checkpoint of a tensor-parallel model is refused before anything is written (the format
    // records rows, not parts along another dimension).
    auto model = fully_shard(TPNet(g, g), mesh);
    e.clear();
    try {
      checkpoint::save(shared_dir() + "/ckpt", model);
    } catch (const std::exception& x) {
      e = x.what();
    }
    EXPECT_NE(e.find("cannot hold tensor-parallel parts yet (parameter 'emb.weight' is split along dimension 0"),
              std::string::npos)
        << e;
  });
}

TEST(TensorParallelFSDP, HybridWithTensorParallelTrainsAsOneProcess) {
  RunOptions o;
  o.timeout = std::chrono::seconds(240);
  run_ranks(
      8,
      [](Rank& r) {
        check_mesh(DeviceMesh(r.pg, {{kReplicateDim, 2}, {kShardDim, 2}, {kTensorDim, 2}}));
      },
      o);
}

}  // namespace
}  // namespace fsdp::testing
