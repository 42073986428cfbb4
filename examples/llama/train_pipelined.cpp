#include "examples/llama/train_pipelined.h"

#include "checkpoint/pipelined.h"
#include "examples/corpus.h"
#include "examples/llama/hf.h"
#include "examples/llama/pipelined.h"
#include "fsdp/fsdp.h"
#include "programs/flags.h"
#include "programs/json_row.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace llama {

using fsdp::programs::usage_error;

std::pair<fsdp::pp::StageLayout, fsdp::pp::ActionLists> pipelined_schedule(const PipelinedRun& run) {
  try {
    const fsdp::pp::StageLayout layout(run.pp, run.stages_per_rank);
    if (layout.stages() > run.cfg.n_layer) {
      usage_error("--pp " + std::to_string(run.pp) + " x --stages-per-rank " + std::to_string(run.stages_per_rank) +
                  " makes " + std::to_string(layout.stages()) + " stages, more than the " +
                  std::to_string(run.cfg.n_layer) + " layers (--n-layer): each stage holds at least one");
    }
    fsdp::pp::ActionLists lists;
    if (run.schedule_file.empty()) {
      lists = fsdp::pp::make_schedule(fsdp::pp::parse_schedule(run.schedule), layout, run.microbatches);
    } else {
      std::ifstream in(run.schedule_file);
      if (!in) usage_error("--pp-schedule-file " + run.schedule_file + ": cannot be read");
      std::stringstream text;
      text << in.rdbuf();
      lists = fsdp::pp::parse_lists(text.str());
    }
    fsdp::pp::validate(lists, layout, run.microbatches);
    if (run.cfg.checkpoint_every > 0) {  // the weight pass of a split backward cannot run through a recompute
      for (const auto& list : lists) {
        for (const auto& a : list) {
          if (a.kind == fsdp::pp::ActionKind::kBackwardInput || a.kind == fsdp::pp::ActionKind::kBackwardWeight) {
            usage_error("--activation-checkpointing with a split backward (" + a.text() +
                        "): zero bubble's weight pass cannot run through a recompute; use 1f1b, gpipe or "
                        "interleaved, or drop --activation-checkpointing");
          }
        }
      }
    }
    return {layout, lists};
  } catch (const std::invalid_argument& e) {
    usage_error(std::string(e.what()) + " (--pp " + std::to_string(run.pp) + ", --microbatches " +
                std::to_string(run.microbatches) + ")");
  }
}

void dump_schedule(const PipelinedRun& run) {
  const auto [layout, lists] = pipelined_schedule(run);
  const auto t = fsdp::pp::simulate(lists, layout, run.microbatches);
  std::cout << "# " << (run.schedule_file.empty() ? run.schedule : run.schedule_file) << ": pp " << run.pp << ", "
            << run.stages_per_rank << " stage(s) per rank, " << run.microbatches << " microbatches; simulated with "
            << "equal times: step " << t.step << ", bubble " << t.bubble << "\n"
            << fsdp::pp::format_lists(lists);
}

namespace {

// --prompt: the prompt's logits through the stages in order, without gradients, before any step:
// each stage's forward on the one before's output (received from its rank, or handed over when
// this rank holds both), the last stage's vocabulary columns gathered over the tensor-parallel
// ranks, then to global rank 0 by one all-reduce over the world (from the last stage's first
// rank; zeros elsewhere). Every rank of every stage takes part. Returns [length, vocabulary].
at::Tensor prompt_logits(const std::vector<int64_t>& prompt, int64_t vocabulary, const fsdp::pp::StageLayout& layout,
                         const fsdp::DeviceMesh& mesh, const fsdp::DeviceMesh& stage_mesh,
                         const std::vector<fsdp::pp::Stage>& stages, const fsdp::tp::Group& vocab) {
  torch::NoGradGuard no_grad;
  const int64_t S = layout.stages(), me = mesh.coordinate(fsdp::kPipeDim);
  fsdp::pp::PointToPoint p2p(mesh);
  at::Tensor h;
  at::Tensor logits = torch::zeros({static_cast<int64_t>(prompt.size()), vocabulary}, torch::kFloat);
  for (const auto& stage : stages) {  // in increasing stage order
    const int64_t s = stage.index;
    if (s == 0) {
      h = torch::tensor(prompt, torch::kLong).unsqueeze(0);
    } else if (layout.rank_of(s - 1) != me) {
      h = p2p.recv(layout.rank_of(s - 1), {fsdp::pp::Payload::kActivation, s - 1, s, 0});
    }
    h = stage.forward(h);
    if (s < S - 1 && layout.rank_of(s + 1) != me) {
      auto sent = p2p.send(h, layout.rank_of(s + 1), {fsdp::pp::Payload::kActivation, s, s + 1, 0});
      p2p.wait(sent);
    }
    if (s == S - 1) {
      const at::Tensor full = fsdp::tp::gather_from_region(h, vocab).squeeze(0).to(torch::kFloat);
      if (stage_mesh.rank() == 0) logits.copy_(full);
    }
  }
  fsdp::all_reduce(mesh.world(), logits);
  return logits;
}

}  // namespace

int train_pipelined(const PipelinedRun& run, fsdp::programs::Program& program) {
  const auto [layout, lists] = pipelined_schedule(run);
  const llama::Config& cfg = run.cfg;
  const int64_t T = cfg.block_size, M = run.microbatches;
  auto data = corpus::load(run.data, run.max_data_mb, T);
  const int64_t samples = corpus::samples(data, T);
  if (samples < run.batch_size) {
    corpus::data_error(run.data, "has " + std::to_string(samples) + " windows, fewer than one global batch");
  }
  fsdp::InitOptions init;
  if (run.timeout) init.timeout(*run.timeout);
  auto world = fsdp::init_process_group(init);
  const int rank = world->getRank(), W = world->getSize();
  program.set_rank(rank);
  if (W % (run.pp * run.tp) != 0) {
    usage_error("--pp " + std::to_string(run.pp) + " x --tp " + std::to_string(run.tp) + " does not divide the " +
                std::to_string(W) + " ranks: the data-parallel size inside each stage is the world over both");
  }
  const int dp = W / static_cast<int>(run.pp * run.tp);
  if (run.batch_size % (dp * M) != 0) {
    usage_error("--batch-size " + std::to_string(run.batch_size) + " does not split into " + std::to_string(dp) +
                " data-parallel shares of --microbatches " + std::to_string(M) + " equal microbatches");
  }
  const int64_t rows = run.batch_size / (dp * M);  // per microbatch, on each data-parallel rank
  fsdp::DeviceMesh mesh(world, {{fsdp::kPipeDim, static_cast<int>(run.pp)},
                                {fsdp::kShardDim, dp},
                                {fsdp::kTensorDim, static_cast<int>(run.tp)}});
  // The stage's own ranks: its FSDP and tensor-parallel layers never span pp.
  const fsdp::DeviceMesh stage_mesh = fsdp::pp::stage_mesh(mesh);
  fsdp::tp::Group blocks(stage_mesh), vocab(stage_mesh);
  // Each stage's model wrapped by FSDP over the stage's ranks (one data-parallel rank: FSDP over
  // one, still the mixed-precision policy and FusedAdamW), driven by the pipeline: gathered once
  // and reduced once per step (pp/pipeline.h). With --build-sharded each layer is sharded as it
  // is built, then its stage wrapped.
  fsdp::FullyShardOptions options;
  options.mixed_precision(run.mixed_precision);
  if (run.timeout) options.timeout(*run.timeout);
  std::optional<ShardAsBuilt> as_built;
  if (run.build_sharded) as_built = ShardAsBuilt{stage_mesh, options};
  PipelinedLlama stages(cfg, blocks, vocab, layout, mesh.coordinate(fsdp::kPipeDim), run.seed, as_built);
  // --from-hf: each stage reads its own tensors (a tied head's embedding on the last stage too, the
  // same bytes as the first stage's, so the two start as one value).
  if (!run.from_hf.empty()) {
    for (auto& m : stages.models) hf::load_weights(run.from_hf, *m, &cfg);
  }
  // The whole model's parameters, over the stages (a sharded parameter keeps its full shape).
  auto count = torch::tensor({stages.whole_parameters()}, torch::kLong);
  fsdp::all_reduce(mesh.group(fsdp::kPipeDim), count);
  const int64_t params = count.item<int64_t>();
  std::vector<fsdp::pp::Stage> pipeline_stages;
  std::vector<std::unique_ptr<torch::optim::Optimizer>> opts;
  std::vector<fsdp::FSDPModule> sharded;  // this rank's stages, wrapped
  const auto adamw = torch::optim::AdamWOptions(run.lr).weight_decay(run.weight_decay);
  for (size_t i = 0; i < stages.models.size(); ++i) {
    auto handle = run.build_sharded ? stages.sharded[i] : fsdp::fully_shard(stages.models[i], stage_mesh, options);
    fsdp::pp::Stage stage{stages.indices[i], [handle](const torch::Tensor& x) mutable { return handle(x); }};
    stage.module = handle;  // the pipeline takes its parameters and drives its FSDP
    pipeline_stages.push_back(std::move(stage));
    opts.push_back(std::make_unique<fsdp::optim::FusedAdamW>(handle, adamw));
    sharded.push_back(handle);
  }
  fsdp::pp::Pipeline pipe(mesh, layout, lists, M, pipeline_stages);
  // fp16: one loss scale over the stages, a step skipped on every rank when any stage overflowed.
  fsdp::optim::ShardedGradScaler scaler(sharded, mesh.group(fsdp::kPipeDim),
                                        fsdp::optim::GradScalerOptions().enabled(run.fp16));
  std::vector<torch::optim::Optimizer*> optimizers;
  for (auto& o : opts) optimizers.push_back(o.get());
  // The stages as a checkpoint holds them: one checkpoint of the whole model (checkpoint/pipelined.h).
  std::vector<fsdp::checkpoint::StageState> checkpointed;
  for (size_t i = 0; i < sharded.size(); ++i) checkpointed.push_back({stages.indices[i], sharded[i], opts[i].get()});
  // --resume: the latest checkpoint's seed (the sampler's), then the stages, AdamW, the generators
  // and the sampler's place, whatever mesh saved it (a pipelined run or one model).
  int64_t first_step = 0;
  uint64_t seed = run.seed;
  examples::Checkpoints checkpoints(run.ckpt);
  const std::string resume_from = checkpoints.resume_from(seed, rank, program.who());
  // Each data-parallel rank its share of every global batch, in the one-process order.
  fsdp::data::DistributedSampler sampler(samples, mesh.coordinate(fsdp::kDataDim), dp,
                                         fsdp::data::SamplerOptions(run.batch_size).seed(seed));
  if (!resume_from.empty()) {
    const auto res = fsdp::checkpoint::load(resume_from, mesh, checkpointed,
                                            fsdp::checkpoint::LoadOptions().sampler(&sampler).in_place(true));
    first_step = res.step;
    if (rank == 0) examples::Checkpoints::print_resumed(res, mesh.shape_text(), run.json, program.who());
    examples::Checkpoints::restore_loss_scale(scaler, res.metadata, rank, program.who());
  }
  if (!run.prompt.empty()) {
    const at::Tensor logits =
        prompt_logits(run.prompt, cfg.vocab_size, layout, mesh, stage_mesh, pipeline_stages, vocab);
    if (rank == 0) hf::write_logits(run.logits_out, logits);
  }
  if (rank == 0 && !run.json) {
    std::cout << "train_llama: " << W << " rank(s) as mesh " << mesh.shape_text() << ", " << cfg.n_layer
              << " layers in " << layout.stages() << " stages (" << run.schedule << ", " << M << " microbatches of "
              << rows << " rows per data-parallel rank)\n";
  }
  // A tied head's copy of the embedding, per stage: the last stage's (when not also the first),
  // counted in the norm and exported by the first stage.
  std::vector<std::vector<std::string>> copies_of;
  std::vector<std::string> copies;
  for (const auto& m : stages.models) {
    const bool copy = cfg.tie_word_embeddings && m->model->range.last() && !m->model->range.first();
    copies_of.push_back(copy ? std::vector<std::string>{"model.embed_tokens.weight"} : std::vector<std::string>{});
    if (copy) copies = copies_of.back();
  }
  double total_ms = 0;  // the steps after the first
  for (int64_t step = first_step; step < run.steps; ++step) {
    for (auto& o : opts) o->zero_grad();
    auto share = sampler.next_share();
    if (!share) share = sampler.next_share();
    const auto xy = corpus::batch(data, share->indices, T);
    // FSDP's collectives this step, over this rank's stages (one all-gather and one reduce-scatter
    // per unit, pp/pipeline.h).
    auto fsdp_collectives = [&] {
      std::pair<int64_t, int64_t> n{0, 0};
      for (const auto& h : sharded) {
        n.first += h.comm_stats().all_gathers;
        n.second += h.comm_stats().reduce_scatters;
      }
      return n;
    };
    const auto collectives_before = fsdp_collectives();
    fsdp::memory::reset_peak();
    const auto rep = pipe.step([&](int64_t m) { return xy.first.narrow(0, m * rows, rows); },
                               [&](const torch::Tensor& logits, int64_t m) {
                                 // Equal microbatches: each loss weighs 1/M of the share's mean (scaled for fp16).
                                 return scaler.scale(fsdp::tp::vocab_parallel_cross_entropy(
                                                         logits, xy.second.narrow(0, m * rows, rows), vocab) /
                                                     static_cast<double>(M));
                               });
    const double loss_scale = scaler.get_scale();  // the scale this step's losses carry
    stages.sum_tied_gradients(mesh);
    scaler.unscale_(optimizers);
    // The norm over the stages' shards (and tensor-parallel parts); a tied head's copy counted by
    // the first stage. NaN on a step fp16 overflowed (skipped on every rank).
    const double grad_norm =
        scaler.found_inf()
            ? std::nan("")
            : fsdp::optim::clip_grad_norm(sharded, mesh.group(fsdp::kPipeDim),
                                          run.clip > 0 ? run.clip : std::numeric_limits<double>::infinity(), copies);
    scaler.step(optimizers);
    scaler.update();
    // The loss from the last stage to every rank, the mean over the data-parallel ranks; the
    // bubble (the largest share of the step a rank waited on transfers) and the bytes moved
    // between stages (each transfer once).
    auto loss = torch::tensor({rep.loss / loss_scale}, torch::kDouble);
    fsdp::all_reduce(mesh.group(fsdp::kPipeDim), loss);
    fsdp::all_reduce(mesh.group(fsdp::kDataDim), loss);
    const double l = loss.item<double>() / dp;
    // The step's allocator peak (this process's CPU bytes: its stages' state and activations).
    auto worst = torch::tensor({rep.bubble(), rep.step_seconds, static_cast<double>(rep.peak_in_flight),
                                static_cast<double>(fsdp::memory::stats().peak_bytes)},
                               torch::kDouble);
    fsdp::all_reduce(world, worst, c10d::ReduceOp::MAX);
    const auto collectives_after = fsdp_collectives();
    auto counts = torch::tensor(
        {collectives_after.first - collectives_before.first, collectives_after.second - collectives_before.second},
        torch::kLong);
    fsdp::all_reduce(world, counts, c10d::ReduceOp::MAX);
    auto bytes = torch::tensor({rep.p2p_bytes}, torch::kLong);
    fsdp::all_reduce(world, bytes);
    if (step > first_step) total_ms += 1000 * worst[1].item<double>();
    if (rank == 0) {
      if (run.json) {
        fsdp::programs::JsonRow()
            .add("step", step)
            .add("loss", l, "%.9g")
            .add("grad_norm", grad_norm, "%.9g")
            .add("step_ms", 1000 * worst[1].item<double>(), "%.3f")
            .add("world_size", W)
            .add("pp", run.pp)
            .add("tp", run.tp)
            .add("dp", dp)
            .add("pp_schedule", run.schedule_file.empty() ? run.schedule : "file")
            .add("microbatches", M)
            .add("stages_per_rank", run.stages_per_rank)
            .add("p2p_bytes", bytes.item<int64_t>() / 2)
            .add("bubble", worst[0].item<double>(), "%.6g")
            .add("peak_in_flight", static_cast<int64_t>(worst[2].item<double>()))
            .add("fsdp_all_gathers", counts[0].item<int64_t>())
            .add("fsdp_reduce_scatters", counts[1].item<int64_t>())
            .add("peak_bytes", static_cast<int64_t>(worst[3].item<double>()))
            .add("params", params)
            .print();
      } else {
        std::printf("step %4lld | loss %.4f | grad norm %.4g | %8.1f ms | bubble %.3f\n", static_cast<long long>(step),
                    l, grad_norm, 1000 * worst[1].item<double>(), worst[0].item<double>());
      }
      std::fflush(stdout);
    }
    if (!std::isfinite(l)) {
      throw std::runtime_error("the loss of step " + std::to_string(step) +
                               " is not finite: training diverged. Lower --lr, or clip with --clip MAX_NORM.");
    }
    // fp16: the loss scale and its growth count go with the checkpoint (grad_scaler.*).
    fsdp::checkpoint::Metadata meta = scaler.state_dict();
    meta.insert(
        {{"seed", std::to_string(seed)}, {"global_batch", std::to_string(run.batch_size)}, {"example", "train_llama"}});
    const std::string saved = checkpoints.after_step(step, mesh, checkpointed, sampler, meta);
    if (rank == 0 && !saved.empty() && !run.json) std::cerr << program.who() << ": " << saved << "\n";
  }
  if (!run.export_hf.empty()) {
    hf::export_model(run.export_hf, sharded, copies_of, mesh, cfg);
    if (rank == 0 && !run.json) std::cout << "train_llama: exported to " << run.export_hf << "\n";
  }
  if (rank == 0 && run.json) {
    fsdp::programs::JsonRow()
        .add("summary", true)
        .add("world_size", W)
        .add("pp", run.pp)
        .add("tp", run.tp)
        .add("dp", dp)
        .add("mesh", mesh.shape_text())
        .add("params", params)
        .add("mean_step_ms",
             run.steps - first_step > 1 ? total_ms / static_cast<double>(run.steps - first_step - 1) : 0.0, "%.3f")
        .print();
  }
  return 0;
}

}  // namespace llama
