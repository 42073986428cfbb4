// FSDP over tensor parallelism: a model of fsdp::tp layers in fsdp::Sharded blocks, wrapped over a
// DeviceMesh, trained 5 steps with AdamW and clipping against the same model of plain LibTorch
// layers in one process on the whole batch. Meshes (tp, dp) = (2, 1), (1, 2) [two 2-rank jobs side
// by side in one 4-rank launch], (2, 2), (4, 1), hybrid over a 1-D dp mesh, and hybrid with tensor
// parallelism (dp_replicate 2 x dp_shard 2 x tp 2, 8 ranks). Losses and the clipped norm within
// 1e-5 relative at every step, the final weights (each rank's part) within 1e-5; with activation
// checkpointing and FusedAdamW too, built in a ShardingScope over the mesh, and with CPU offload
// (its CPU seam) at (2, 2).
#include "fsdp/fsdp.h"
#include "fsdp/internal/race_delay.h"
#include "tests/harness.h"
#include "tests/models.h"
#include "tests/tp/tp_models.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace fsdp::testing {
namespace {

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
                            (fused ? ", FusedAdamW" : "") + (built_sharded ? ", built in a ShardingScope" : "") +
                            (options.offload_policy().has_value() ? ", CPU offload" : "");
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
  for (int s = 0; s < kSteps; ++s) {
    const auto [got, norm] = tp_step(model, *opt, mesh, s);
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
    const torch::Tensor r = part_of(ref[s.name], s);
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

// A parameter that is this rank's part of a [8] scale (its values differ between the TP ranks),
// declared wrongly on purpose: mode 0 a SplitModule naming no parameter, 1 a split along a
// dimension it lacks, 2 no SplitModule at all.
struct ScaleImpl : torch::nn::Module, SplitModule {
  ScaleImpl(const tp::Group& g, int mode) : g(g), mode(mode) {
    scale = register_parameter("scale", torch::arange(4.0) + 4.0 * g.rank());
  }
  std::vector<std::pair<std::string, TensorSplit>> parameter_splits() const override {
    if (mode == 0) return {};
    return {{"scale", TensorSplit{1, g.rank(), g.size()}}};
  }
  std::vector<int> split_ranks() const override { return g.global_ranks(); }
  tp::Group g;
  int mode;
  torch::Tensor scale;
};
struct PlainScaleImpl : torch::nn::Module {
  explicit PlainScaleImpl(const tp::Group& g) {
    scale = register_parameter("scale", torch::arange(4.0) + 4.0 * g.rank());
  }
  torch::Tensor scale;
};
struct PartScaleImpl : torch::nn::Module {
  PartScaleImpl(const tp::Group& g, int mode) {
    if (mode < 2) {
      register_module("h", std::make_shared<ScaleImpl>(g, mode));
    } else {
      register_module("h", std::make_shared<PlainScaleImpl>(g));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) { return x; }
};
TORCH_MODULE(PartScale);

TEST(TensorParallelFSDP, TrainsAsOneProcessOnEveryMesh) {
  RunOptions offload_seam;  // a CPU model may take CPUOffloadPolicy (FSDP_TEST_OFFLOAD_ON_CPU)
  offload_seam.env["FSDP_TEST_OFFLOAD_ON_CPU"] = "1";
  run_ranks(
      4,
      [](Rank& r) {
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
        // CPU offload (through its CPU seam: host shards and gradients, every copy of the CUDA path).
        check_mesh(DeviceMesh(r.pg, {{kShardDim, 2}, {kTensorDim, 2}}),
                   FullyShardOptions().offload_policy(CPUOffloadPolicy()));
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
        // A user's SplitModule that leaves out its parameter, or claims a split the mesh cannot hold,
        // and a plain module whose parameter differs between the tensor-parallel ranks: refused at
        // wrapping (a checkpoint would otherwise mix the ranks' values and clipping miss the parts).
        for (const auto& [mode, expect] : std::vector<std::pair<int, std::string>>{
                 {0, "is a SplitModule but its parameter_splits() does not name its parameter 'scale'"},
                 {1, "says parameter 'scale' (shape [4]) is part " + std::to_string(r.rank % 2) +
                         " of 2 along dimension 1"},
                 {2, "parameter 'h.scale' differs between this rank and global rank "}}) {
          e = error_of([&, mode = mode] { fully_shard(PartScale(g, mode), mesh); });
          EXPECT_NE(e.find(expect), std::string::npos) << mode << ": " << e;
        }
      },
      offload_seam);
}

// The race switch (fsdp/internal/race_delay.h) over FSDP 2 x TP 2: the tensor-parallel conjugates'
// collectives and FSDP's, delayed at random, give the same losses, norms and weights bit for bit,
// with prefetch 2 and with activation checkpointing (the blocks' collectives run again in backward).
TEST(TensorParallelFSDP, RaceDelaysChangeNothingOnAMesh) {
  run_ranks(4, [](Rank& r) {
    const DeviceMesh mesh(r.pg, {{kShardDim, 2}, {kTensorDim, 2}});
    auto train = [&](uint64_t seed, const FullyShardOptions& options) {
      detail::set_race_delay_for_testing(seed);
      tp::Group blocks(mesh), vocab(mesh);
      torch::manual_seed(3);
      auto model = fully_shard(TPNet(blocks, vocab), mesh, options);
      torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
      std::vector<double> out;
      for (int s = 0; s < kSteps; ++s) {
        const auto [loss, norm] = tp_step(model, opt, mesh, s);
        out.push_back(loss);
        out.push_back(norm);
      }
      std::vector<at::Tensor> weights;
      for (const auto& p : model.parameters()) weights.push_back(p.detach().clone());
      detail::set_race_delay_for_testing(0);
      return std::make_pair(out, weights);
    };
    for (const auto& options :
         {FullyShardOptions().prefetch(2), FullyShardOptions().activation_checkpointing_every(1)}) {
      const int64_t before = detail::race_delays_applied();
      const auto off = train(0, options);
      const auto on = train(11, options);
      EXPECT_GT(detail::race_delays_applied(), before);
      EXPECT_EQ(on.first, off.first) << "losses and norms with race delays differ from those without";
      ASSERT_EQ(on.second.size(), off.second.size());
      for (size_t i = 0; i < on.second.size(); ++i) {
        EXPECT_TRUE(torch::equal(on.second[i], off.second[i])) << "weight " << i << " differs with race delays";
      }
    }
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
