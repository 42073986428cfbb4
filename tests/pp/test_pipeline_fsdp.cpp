// FSDP inside pipeline stages: each stage's model wrapped by fully_shard over its own ranks
// (pp::stage_mesh), the pipeline's transfers over pp, trained as one process trains the whole model
// at 4 ranks, (pp 2, dp_shard 2):
//   - GPipe with the stage's FSDP left to itself (Stage::module unset): several forwards of one
//     unit before their backwards, each backward gathering the unit again (Unit::pre_backward per
//     forward) and reducing its gradients;
//   - 1F1B and zero bubble (ZB-H1: its split backward) driven by the pipeline (Stage::module): each
//     unit gathered once and reduce-scattered once per step, counted;
//   - 1F1B with Stage::reshard_between_microbatches: gathered per forward and backward, reduced once;
//   - stages built sharded (llama::ShardAsBuilt, a ShardingScope over the stage's ranks): the
//     shards of the stages built whole and then wrapped, bit for bit, and each layer whole on the
//     rank only while it is built (the peak from the shapes).
#include "examples/llama/pipelined.h"
#include "fsdp/fsdp.h"
#include "tests/harness.h"
#include "tests/mixed_reference.h"
#include "tests/models.h"
#include "tests/pp/microbatches.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

namespace fsdp::testing {
namespace {

constexpr int64_t kSteps = 3, kMicrobatches = 4, kRows = 2, kDp = 2;

llama::Config fsdp_config() {
  llama::Config c;
  c.vocab_size = 48;
  c.block_size = 8;
  c.n_layer = 5;
  c.n_head = 4;
  c.n_embd = 16;
  c.intermediate = 24;
  return c;
}

enum class Drive { kLeft, kOncePerStep, kPerMicrobatch };

void check(Rank& r, pp::ScheduleKind kind, Drive drive) {
  const auto cfg = fsdp_config();
  const std::string label = pp::to_string(kind) + (drive == Drive::kLeft          ? " (FSDP left to itself)"
                                                   : drive == Drive::kOncePerStep ? " (driven)"
                                                                                  : " (resharded per microbatch)");
  DeviceMesh mesh(r.pg, {{kPipeDim, 2}, {kShardDim, static_cast<int>(kDp)}});
  const int64_t stage_coord = mesh.coordinate(kPipeDim), d = mesh.coordinate(kShardDim);
  const DeviceMesh stage_mesh = pp::stage_mesh(mesh);
  EXPECT_EQ(stage_mesh.shape_text(), "(dp_shard 2)");
  // This stage's two ranks (global ranks 2c and 2c + 1), as the mesh's own world.
  EXPECT_EQ(stage_mesh.world_size(), 2);
  EXPECT_EQ(stage_mesh.rank(), r.rank % 2);
  const tp::Group g(stage_mesh);
  torch::manual_seed(7);
  llama::LlamaForCausalLM whole(cfg, g, g);
  torch::optim::AdamW ref_opt(whole->parameters(), torch::optim::AdamWOptions(3e-3));
  const pp::StageLayout layout(2);
  llama::PipelinedLlama stages(cfg, g, g, layout, stage_coord, 7);
  auto model = fully_shard(stages.models[0], stage_mesh);
  optim::FusedAdamW opt(model, torch::optim::AdamWOptions(3e-3));
  const auto lists = pp::make_schedule(kind, layout, kMicrobatches);
  pp::Stage stage{stages.indices[0], [&](const torch::Tensor& x) { return model(x); }, model.parameters()};
  if (drive != Drive::kLeft) stage.module = model;
  stage.reshard_between_microbatches = drive == Drive::kPerMicrobatch;
  pp::Pipeline pipe(mesh, layout, lists, kMicrobatches, {stage});
  // The units holding parameters: each one collective of each kind per step when driven.
  int64_t units = 0;
  for (const auto& u : model.units()) units += u.shard_numel > 0 ? 1 : 0;
  EXPECT_EQ(units, stages.ranges[static_cast<size_t>(stage_coord)].size() + 1) << "the stage's layers and its root";
  for (int64_t step = 0; step < kSteps; ++step) {
    ref_opt.zero_grad();
    double ref_loss = 0;
    for (int64_t dd = 0; dd < kDp; ++dd) {
      for (int64_t m = 0; m < kMicrobatches; ++m) {
        const auto [x, y] = microbatch(step, m, cfg.vocab_size, kRows, dd);
        auto l = whole->loss(x, y) * (token_share(m, kMicrobatches) / kDp);
        l.backward();
        ref_loss += l.item<double>();
      }
    }
    ref_opt.step();
    opt.zero_grad();
    const CommStats before = model.comm_stats();
    const auto rep = pipe.step([&](int64_t m) { return microbatch(step, m, cfg.vocab_size, kRows, d).first; },
                               [&](const torch::Tensor& logits, int64_t m) {
                                 return tp::vocab_parallel_cross_entropy(
                                            logits, microbatch(step, m, cfg.vocab_size, kRows, d).second, g) *
                                        token_share(m, kMicrobatches);
                               });
    const CommStats& after = model.comm_stats();
    const int64_t gathers = after.all_gathers - before.all_gathers,
                  reductions = after.reduce_scatters - before.reduce_scatters;
    if (drive == Drive::kLeft) {  // a reduction per microbatch's backward
      EXPECT_EQ(reductions, kMicrobatches * units) << label;
    } else {
      EXPECT_EQ(reductions, units) << label << ": one reduce-scatter per unit per step";
    }
    if (drive == Drive::kOncePerStep) {
      EXPECT_EQ(gathers, units) << label << ": one all-gather per unit per step";
    } else {
      EXPECT_GT(gathers, units) << label;
    }
    EXPECT_FALSE(model.step_in_progress()) << label;
    EXPECT_TRUE(model.requires_gradient_sync()) << label << ": the controls back to their defaults";
    opt.step();
    auto loss = torch::tensor({rep.loss / kDp}, torch::kDouble);
    all_reduce(r.pg, loss);
    EXPECT_NEAR(loss.item<double>(), ref_loss, 1e-5 * std::abs(ref_loss)) << label << ", step " << step;
  }
  // The weights after the steps: AdamW's normalised update turns the reductions' other order into
  // differences of a few 1e-5 on the rare elements whose gradient is near zero; 1e-4.
  const auto want = whole->named_parameters();
  for (const auto& item : model.full_state_dict()) {
    EXPECT_LT(rel_diff(item.value(), want[item.key()]), 1e-4) << label << ": " << item.key();
  }
}

// Zero bubble under mixed precision: the parameters between passes point at shards of another
// dtype (autograd drops their accumulator pointers then), yet every weight gets its gradient,
// those of 1F1B under the same policy (bf16 sums of W's gradients between two input passes: 1e-2).
void zero_bubble_under_mixed_precision(Rank& r) {
  const auto cfg = fsdp_config();
  DeviceMesh mesh(r.pg, {{kPipeDim, 2}, {kShardDim, static_cast<int>(kDp)}});
  const int64_t stage_coord = mesh.coordinate(kPipeDim), d = mesh.coordinate(kShardDim);
  const DeviceMesh stage_mesh = pp::stage_mesh(mesh);
  const tp::Group g(stage_mesh);
  const pp::StageLayout layout(2);
  const auto bf16 = FullyShardOptions().mixed_precision(MixedPrecisionPolicy().param_dtype(torch::kBFloat16));
  std::map<std::string, torch::Tensor> grads[2];
  int i = 0;
  for (const auto kind : {pp::ScheduleKind::k1F1B, pp::ScheduleKind::kZeroBubble}) {
    llama::PipelinedLlama stages(cfg, g, g, layout, stage_coord, 7);
    auto model = fully_shard(stages.models[0], stage_mesh, bf16);
    pp::Stage stage{stages.indices[0], [&](const torch::Tensor& x) { return model(x); }};
    stage.module = model;
    pp::Pipeline pipe(mesh, layout, pp::make_schedule(kind, layout, kMicrobatches), kMicrobatches, {stage});
    pipe.step([&](int64_t m) { return microbatch(0, m, cfg.vocab_size, kRows, d).first; },
              [&](const torch::Tensor& logits, int64_t m) {
                return tp::vocab_parallel_cross_entropy(logits.to(torch::kFloat),
                                                        microbatch(0, m, cfg.vocab_size, kRows, d).second, g) *
                       token_share(m, kMicrobatches);
              });
    for (const auto& p : model.named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << pp::to_string(kind) << ": " << p.key();
      grads[i][p.key()] = p.value().grad().clone();
    }
    ++i;
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (const auto& [name, want] : grads[0]) {
    EXPECT_LT(rel_diff(grads[1][name], want), 1e-2) << name << " on rank " << r.rank;
  }
}

// Each stage built inside a ShardingScope over its own ranks: its decoder layers sharded as each is
// built. The shards are those of the same stage built whole and wrapped; the peak while building is
// exactly, from the shapes, the root's embedding (built first), the shards of the layers before,
// and one layer whole beside its new shard or its initialization's two temporaries (of its largest
// weight), whichever is larger, or at the end the root whole beside every shard: never the whole
// stage.
void built_sharded(Rank& r) {
  auto cfg = fsdp_config();
  cfg.n_layer = 7;                 // 4 and 3 layers: at 2 ranks a stage of 2 would peak at its whole size
  cfg.tie_word_embeddings = true;  // the embedding on both stages: root parameters, built before the layers
  memory::enable_cpu_counting();
  DeviceMesh mesh(r.pg, {{kPipeDim, 2}, {kShardDim, static_cast<int>(kDp)}});
  const int64_t stage_coord = mesh.coordinate(kPipeDim);
  const DeviceMesh stage_mesh = pp::stage_mesh(mesh);
  const tp::Group g(stage_mesh);
  const pp::StageLayout layout(2);
  const int64_t base = memory::stats().current_bytes;
  memory::reset_peak();
  llama::PipelinedLlama built(cfg, g, g, layout, stage_coord, 7, llama::ShardAsBuilt{stage_mesh, {}});
  const int64_t peak = memory::stats().peak_bytes - base, left = memory::stats().current_bytes - base;
  ASSERT_EQ(built.sharded.size(), 1u);
  llama::PipelinedLlama whole(cfg, g, g, layout, stage_coord, 7);
  int64_t whole_bytes = 0;
  std::map<std::string, int64_t> bytes;  // of each parameter, whole (before fully_shard makes them shards)
  for (const auto& p : whole.models[0]->named_parameters()) {
    bytes[p.key()] = p.value().numel() * 4;
    whole_bytes += bytes[p.key()];
  }
  EXPECT_EQ(built.whole_parameters(), whole.whole_parameters()) << "counted from the built stage's shard specs";
  auto wrapped = fully_shard(whole.models[0], stage_mesh);
  const auto a = built.sharded[0].units(), b = wrapped.units();
  ASSERT_EQ(a.size(), b.size());
  // The bound from the shapes, in build order: the embedding (built first), then each layer.
  int64_t shards = 0, bound = 0, root = 0, root_largest = 0;
  for (const auto& [name, n] : bytes) {
    if (name.rfind("model.layers.", 0) == 0) continue;
    root += n;
    root_largest = std::max(root_largest, n);
  }
  const int64_t embedding = bytes.at("model.embed_tokens.weight");
  for (size_t u = 0; u < a.size(); ++u) {
    EXPECT_EQ(a[u].name, b[u].name);
    EXPECT_TRUE(torch::equal(a[u].flat_shard, b[u].flat_shard)) << "unit '" << a[u].name << "' on rank " << r.rank;
    if (u == 0) continue;  // the root: sharded by fully_shard, after the layers
    int64_t layer = 0, largest = 0;
    for (const auto& name : a[u].params) {
      layer += bytes.at(name);
      largest = std::max(largest, bytes.at(name));
    }
    // The layer whole beside its initialization's two temporaries, then beside its new shard.
    bound = std::max(bound, embedding + shards + layer + std::max(2 * largest, a[u].shard_numel * 4));
    shards += a[u].shard_numel * 4;
  }
  // Then the root initialized (two temporaries of its largest weight), and sharded by fully_shard.
  bound = std::max({bound, root + shards + 2 * root_largest, root + shards + a[0].shard_numel * 4});
  std::cout << "rank " << r.rank << ", stage " << stage_coord << " built sharded: peak " << peak << " bytes (bound "
            << bound << "), the stage whole " << whole_bytes << ", left " << left << " (shards "
            << shards + a[0].shard_numel * 4 << ")" << std::endl;
  EXPECT_EQ(peak, bound) << "exactly: one layer whole at a time, beside the shards before it and its own";
  EXPECT_LT(peak, whole_bytes) << "the stage existed whole on rank " << r.rank;
  EXPECT_EQ(left, shards + a[0].shard_numel * 4) << "only the shards are left once the stage is wrapped";
}

TEST(PipelineFSDP, StagesShardedOverTheirOwnRanks) {
  run_ranks(4, [](Rank& r) {
    check(r, pp::ScheduleKind::kGPipe, Drive::kLeft);
    check(r, pp::ScheduleKind::k1F1B, Drive::kOncePerStep);
    check(r, pp::ScheduleKind::kZeroBubble, Drive::kOncePerStep);
    check(r, pp::ScheduleKind::k1F1B, Drive::kPerMicrobatch);
    zero_bubble_under_mixed_precision(r);
    built_sharded(r);
  });
}

}  // namespace
}  // namespace fsdp::testing
