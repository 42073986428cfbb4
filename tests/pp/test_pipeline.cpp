// fsdp::pp::Pipeline (pp/pipeline.h) trains the Llama's stages as one process trains the whole
// model: every schedule at 2 and 4 pipeline ranks, layers split unevenly, a tied embedding and
// head on the first and last stage, microbatches of different sequence lengths, AdamW with
// clipping over 5 steps, to 1e-5; each step's transfers and bytes are those of the schedule and
// the shapes, and the microbatches in flight at the peak those the validator simulates.
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

constexpr int64_t kSteps = 5, kMicrobatches = 4, kRows = 2;
constexpr double kClip = 0.5;  // below the gradients' norm: clipping is in play

llama::Config pipe_config(int64_t layers) {
  llama::Config c;
  c.vocab_size = 48;
  c.block_size = 8;
  c.n_layer = layers;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.n_embd = 16;
  c.intermediate = 24;
  c.tie_word_embeddings = true;
  return c;
}

void check_schedule(Rank& r, pp::ScheduleKind kind, int64_t per_rank, int64_t layers) {
  const int64_t P = r.world_size;
  const std::string label = pp::to_string(kind) + " at pp " + std::to_string(P) + ", " + std::to_string(per_rank) +
                            " stage(s) per rank, " + std::to_string(layers) + " layers";
  const auto cfg = pipe_config(layers);
  DeviceMesh mesh(r.pg, {{kPipeDim, static_cast<int>(P)}});
  const tp::Group g(mesh);  // one rank: no tensor parallelism
  // One process: the whole model, the same microbatches accumulated.
  torch::manual_seed(7);
  llama::LlamaForCausalLM whole(cfg, g, g);
  torch::optim::AdamW ref_opt(whole->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.1));
  // The pipeline: this rank's stages only.
  const pp::StageLayout layout(P, per_rank);
  llama::PipelinedLlama stages(cfg, g, g, layout, mesh.coordinate(kPipeDim), 7);
  const auto lists = pp::make_schedule(kind, layout, kMicrobatches);
  pp::Pipeline pipe(mesh, layout, lists, kMicrobatches, stages.stages());
  torch::optim::AdamW opt(stages.parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.1));
  const auto sim = pp::simulate(lists, layout, kMicrobatches);
  // The bytes this rank's transfers carry: [kRows, 4 + m, C] fp32 each, sent or received.
  int64_t want_bytes = 0, want_transfers = 0;
  for (const auto& a : lists[static_cast<size_t>(r.rank)]) {
    if (a.is_send() || a.is_recv()) {
      want_bytes += kRows * (4 + a.microbatch) * cfg.n_embd * 4;
      ++want_transfers;
    }
  }
  for (int64_t step = 0; step < kSteps; ++step) {
    ref_opt.zero_grad();
    double ref_loss = 0;
    for (int64_t m = 0; m < kMicrobatches; ++m) {
      const auto [x, y] = microbatch(step, m, cfg.vocab_size, kRows);
      auto l = whole->loss(x, y) * token_share(m, kMicrobatches);
      l.backward();
      ref_loss += l.item<double>();
    }
    const double ref_norm = torch::nn::utils::clip_grad_norm_(whole->parameters(), kClip);
    ref_opt.step();

    opt.zero_grad();
    pipe.p2p().reset_comm_stats();
    const auto rep = pipe.step([&](int64_t m) { return microbatch(step, m, cfg.vocab_size, kRows).first; },
                               [&](const torch::Tensor& logits, int64_t m) {
                                 return tp::vocab_parallel_cross_entropy(
                                            logits, microbatch(step, m, cfg.vocab_size, kRows).second, g) *
                                        token_share(m, kMicrobatches);
                               });
    stages.sum_tied_gradients(mesh);
    const double norm = stages.clip_grad_norm(mesh, kClip);
    opt.step();
    auto loss = torch::tensor({rep.loss}, torch::kDouble);
    all_reduce(mesh.group(kPipeDim), loss);  // the last stage's, to every rank
    EXPECT_NEAR(loss.item<double>(), ref_loss, 1e-5 * std::abs(ref_loss)) << label << ", step " << step;
    EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm) << label << ", step " << step;
    EXPECT_GT(ref_norm, kClip) << label << ": clipping must act";
    EXPECT_EQ(rep.p2p_bytes, want_bytes) << label << ", step " << step;
    EXPECT_EQ(pipe.p2p().comm_stats().sends + pipe.p2p().comm_stats().recvs, 2 * want_transfers) << label;
    EXPECT_EQ(rep.peak_in_flight, sim.peak_in_flight[static_cast<size_t>(r.rank)]) << label;
  }
  // Every stage's parameters are the whole model's after the 5 steps, the tied copies included.
  const auto want = whole->named_parameters();
  for (const auto& m : stages.models) {
    for (const auto& p : m->named_parameters()) {
      EXPECT_LT(rel_diff(p.value(), want[p.key()]), 1e-5) << label << ": " << p.key();
    }
  }
}

TEST(Pipeline, EveryScheduleTrainsAsOneProcess) {
  run_ranks(2, [](Rank& r) {
    // Ranks given different schedules are refused before any step, every rank alike.
    {
      DeviceMesh mesh(r.pg, {{kPipeDim, 2}});
      const pp::StageLayout layout(2);
      const auto kind = r.rank == 0 ? pp::ScheduleKind::k1F1B : pp::ScheduleKind::kGPipe;
      const tp::Group g(mesh);
      llama::PipelinedLlama stages(pipe_config(3), g, g, layout, r.rank, 7);
      const std::string e = error_of([&] {
        pp::Pipeline(mesh, layout, pp::make_schedule(kind, layout, kMicrobatches), kMicrobatches, stages.stages());
      });
      EXPECT_NE(e.find("the pipeline's ranks were given different schedules"), std::string::npos) << e;
    }
    check_schedule(r, pp::ScheduleKind::kGPipe, 1, 5);  // 5 layers on 2 stages: 2 and 3
    check_schedule(r, pp::ScheduleKind::k1F1B, 1, 5);
    check_schedule(r, pp::ScheduleKind::kZeroBubble, 1, 5);
    check_schedule(r, pp::ScheduleKind::kInterleaved1F1B, 2, 5);  // 4 stages: 1, 1, 1 and 2 layers
  });
  run_ranks(4, [](Rank& r) {
    check_schedule(r, pp::ScheduleKind::kGPipe, 1, 5);
    check_schedule(r, pp::ScheduleKind::k1F1B, 1, 5);
    check_schedule(r, pp::ScheduleKind::kZeroBubble, 1, 6);
    check_schedule(r, pp::ScheduleKind::kInterleaved1F1B, 2, 9);
  });
}

}  // namespace
}  // namespace fsdp::testing
