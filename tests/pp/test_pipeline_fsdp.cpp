// FSDP inside pipeline stages: each stage's model wrapped by fully_shard over its own ranks
// (pp::stage_mesh), the pipeline's transfers over pp, trained as one process trains the whole model
// at 4 ranks, (pp 2, dp_shard 2), with GPipe and 1F1B: several forwards of one unit before their
// backwards (each forward's backward re-gathers the unit, Unit::pre_backward per forward).
#include "examples/llama/pipelined.h"
#include "fsdp/fsdp.h"
#include "tests/harness.h"
#include "tests/mixed_reference.h"
#include "tests/models.h"
#include "tests/pp/microbatches.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

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

void check(Rank& r, pp::ScheduleKind kind) {
  const auto cfg = fsdp_config();
  const std::string label = pp::to_string(kind);
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
  pp::Pipeline pipe(mesh, layout, lists, kMicrobatches,
                    {{stages.indices[0], [&](const torch::Tensor& x) { return model(x); }, model.parameters()}});
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
    const auto rep = pipe.step([&](int64_t m) { return microbatch(step, m, cfg.vocab_size, kRows, d).first; },
                               [&](const torch::Tensor& logits, int64_t m) {
                                 return tp::vocab_parallel_cross_entropy(
                                            logits, microbatch(step, m, cfg.vocab_size, kRows, d).second, g) *
                                        token_share(m, kMicrobatches);
                               });
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

TEST(PipelineFSDP, StagesShardedOverTheirOwnRanks) {
  run_ranks(4, [](Rank& r) {
    check(r, pp::ScheduleKind::kGPipe);
    check(r, pp::ScheduleKind::k1F1B);
  });
}

}  // namespace
}  // namespace fsdp::testing
