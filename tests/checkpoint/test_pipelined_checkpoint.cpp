// Checkpoints of a pipelined model (checkpoint/pipelined.h), at 4 ranks: a Llama of 5 layers with a
// tied embedding and head, trained 2 steps as (pp 2, dp_shard 2) with FSDP in each stage, saved as
// one checkpoint of the whole model:
//   - its tensors are the whole model's, each once (the tied weight too), and a plain module
//     loads it bit for bit what every stage's gathered weights are;
//   - (pp 4) stages load it bit for bit, and their save of it holds the same model and optimizer
//     tensors byte for byte (the optimizer's state and steps went through the load);
//   - stages that hold less than the checkpoint (a 4-layer pipeline) are refused on every rank
//     naming what no stage holds, unless not strict; a save whose stages' optimizers disagree (one
//     stage without), or whose stages' copies of the tied weight differ, is refused on every rank,
//     nothing committed.
#include "checkpoint/commit.h"
#include "checkpoint/pipelined.h"
#include "examples/llama/pipelined.h"
#include "fsdp/fsdp.h"
#include "tests/checkpoint_helpers.h"
#include "tests/harness.h"
#include "tests/pp/microbatches.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp::testing {
namespace {

constexpr int64_t kMicrobatches = 4, kRows = 2;

llama::Config config(int64_t layers) {
  llama::Config c;
  c.vocab_size = 48;
  c.block_size = 8;
  c.n_layer = layers;
  c.n_head = 4;
  c.n_embd = 16;
  c.intermediate = 24;
  c.tie_word_embeddings = true;
  return c;
}

// This rank's stages of a pipeline of `pp` stages (each FSDP over its stage's ranks, FusedAdamW).
struct Pipelined {
  DeviceMesh mesh, stage_mesh;
  tp::Group g;
  pp::StageLayout layout;
  llama::PipelinedLlama stages;
  FullyShardedModule<llama::LlamaForCausalLMImpl> model;
  std::unique_ptr<optim::FusedAdamW> opt;

  Pipelined(Rank& r, int pp, int64_t layers, uint64_t seed)
      : mesh(r.pg, {{kPipeDim, pp}, {kShardDim, r.world_size / pp}}),
        stage_mesh(pp::stage_mesh(mesh)),
        g(stage_mesh),
        layout(pp),
        stages(config(layers), g, g, layout, mesh.coordinate(kPipeDim), seed),
        model(fully_shard(stages.models[0], stage_mesh)),
        opt(std::make_unique<optim::FusedAdamW>(model, torch::optim::AdamWOptions(3e-3))) {}

  std::vector<checkpoint::StageState> state(bool with_optimizer = true) {
    return {{stages.indices[0], model, with_optimizer ? opt.get() : nullptr}};
  }

  // One 1F1B step over the step's microbatches of this rank's data-parallel share.
  void train(int64_t step) {
    const int64_t d = mesh.coordinate(kShardDim);
    pp::Stage stage{stages.indices[0], [&](const torch::Tensor& x) { return model(x); }};
    stage.module = model;
    pp::Pipeline pipe(mesh, layout, pp::make_schedule(pp::ScheduleKind::k1F1B, layout, kMicrobatches), kMicrobatches,
                      {stage});
    opt->zero_grad();
    const int64_t vocab = stages.config.vocab_size;
    pipe.step([&](int64_t m) { return microbatch(step, m, vocab, kRows, d).first; },
              [&](const torch::Tensor& logits, int64_t m) {
                return tp::vocab_parallel_cross_entropy(logits, microbatch(step, m, vocab, kRows, d).second, g) *
                       token_share(m, kMicrobatches);
              });
    stages.sum_tied_gradients(mesh);
    // As train_llama: the norm over the stages (the tied copy counted once), which also tells FSDP
    // the gradients were rescaled by the library.
    const std::vector<std::string> copies = stages.tied_copy().defined()
                                                ? std::vector<std::string>{"model.embed_tokens.weight"}
                                                : std::vector<std::string>{};
    optim::clip_grad_norm({model}, mesh.group(kPipeDim), 1.0, copies);
    opt->step();
  }
};

// Every weight of this rank's stage, gathered, equal bit for bit to the plain module's.
void expect_stage_is(const FSDPModule& model, const torch::nn::Module& plain, const std::string& what) {
  const auto want = plain.named_parameters();
  const auto full = model.full_state_dict();
  ASSERT_GT(full.size(), 0U);
  for (const auto& item : full) {
    const at::Tensor* w = want.find(item.key());
    ASSERT_NE(w, nullptr) << what << ": " << item.key();
    EXPECT_TRUE(item.value().equal(*w)) << what << ": " << item.key() << " differs";
  }
}

TEST(PipelinedCheckpoint, OneModelSavedLoadsOnAnyMeshAndIntoAPlainModule) {
  run_ranks(4, [](Rank& r) {
    const std::string dir = shared_dir() + "/ckpt", again = shared_dir() + "/again";
    Pipelined two(r, 2, 5, 7);
    for (int64_t step = 0; step < 2; ++step) two.train(step);
    const auto saved = checkpoint::save(dir, two.mesh, two.state(), checkpoint::SaveOptions().step(2));
    const std::string path = saved.path;

    // The whole model's tensors, each once: a tied head is the embedding (no lm_head, one embedding).
    torch::manual_seed(11);
    llama::LlamaForCausalLM plain(config(5), two.g, two.g);  // a one-rank tensor-parallel group: plain layers
    const auto m = checkpoint::read_manifest(path);
    int64_t model_tensors = 0, embeddings = 0;
    for (const auto& t : m.tensors) {
      model_tensors += t.key.rfind("model/", 0) == 0 ? 1 : 0;
      embeddings += t.key == "model/model.embed_tokens.weight" ? 1 : 0;
    }
    EXPECT_EQ(model_tensors, static_cast<int64_t>(plain->named_parameters().size()));
    EXPECT_EQ(embeddings, 1);
    EXPECT_EQ(m.world_size, 4);
    ASSERT_EQ(m.optimizer.param_groups.size(), 1U);
    EXPECT_EQ(m.optimizer.param_groups[0].params.size(), plain->parameters().size())
        << "the stages' optimizers as one, a tied weight once";

    // A plain module: every stage's gathered weights, bit for bit (the last stage's tied copy too).
    checkpoint::load(path, *plain);
    expect_stage_is(two.model, *plain, "(pp 2, dp_shard 2) against the plain module");

    // Four stages of one rank each load it, bit for bit; their save holds the same tensors.
    Pipelined four(r, 4, 5, 99);  // other initial weights: the load must replace them all
    const auto loaded = checkpoint::load(path, four.mesh, four.state());
    EXPECT_EQ(loaded.step, 2);
    EXPECT_EQ(loaded.saved_world_size, 4);
    expect_stage_is(four.model, *plain, "(pp 4) against the plain module");
    const auto resaved = checkpoint::save(again, four.mesh, four.state(), checkpoint::SaveOptions().step(2));
    const auto a = read_all(path), b = read_all(resaved.path);
    for (const auto& [key, t] : a) {
      if (key.rfind("rng/", 0) == 0) continue;  // each rank's own generators
      ASSERT_EQ(b.count(key), 1U) << key;
      EXPECT_TRUE(t.equal(b.at(key))) << key << " differs after a load at (pp 4) and its save";
    }
    EXPECT_EQ(checkpoint::read_manifest(resaved.path).optimizer.steps, m.optimizer.steps);

    // Stages that hold less than the checkpoint: refused on every rank, naming what none holds.
    Pipelined fewer(r, 2, 4, 7);
    const std::string refused = error_of([&] { checkpoint::load(path, fewer.mesh, fewer.state()); });
    EXPECT_NE(refused.find("no stage holds"), std::string::npos) << "every rank names them: " << refused;
    EXPECT_NE(refused.find("model/model.layers.4."), std::string::npos) << refused;
    checkpoint::load(path, fewer.mesh, fewer.state(), checkpoint::LoadOptions().strict(false));
    expect_stage_is(fewer.model, *plain, "a 4-layer pipeline loading 5 layers, not strict");

    // A stage without its optimizer while the other has one: refused on every rank, the
    // checkpoint before it still the latest.
    const bool first_stage = two.mesh.coordinate(kPipeDim) == 0;
    const std::string unlike =
        error_of([&] { checkpoint::save(dir, two.mesh, two.state(first_stage), checkpoint::SaveOptions().step(3)); });
    EXPECT_NE(unlike.find("has no optimizer"), std::string::npos) << unlike;
    EXPECT_EQ(checkpoint::latest_checkpoint(dir), path);

    // The last stage's copy of the tied embedding no longer the first stage's (its gradients not
    // summed): refused on every rank, naming the weight, nothing committed.
    if (!first_stage) {
      torch::NoGradGuard no_grad;
      two.stages.tied_copy().add_(1e-3);
    }
    const std::string diverged =
        error_of([&] { checkpoint::save(dir, two.mesh, two.state(), checkpoint::SaveOptions().step(4)); });
    EXPECT_NE(diverged.find("'model.embed_tokens.weight' (a tensor stages 0 and 1 both hold: a tied weight) differs"),
              std::string::npos)
        << diverged;
    EXPECT_EQ(checkpoint::latest_checkpoint(dir), path);
  });
}

}  // namespace
}  // namespace fsdp::testing
