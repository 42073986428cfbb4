// Trains a Llama (examples/llama/llama.h) with tensor parallelism and FSDP on a 2-D mesh.
//
//   build/examples/train_llama --steps 20                                            # one process
//   torchrun --no-python --nproc-per-node 4 build/examples/train_llama --tp 2        # FSDP 2 x TP 2
//
// The mesh is (dp_shard N/T, tp T), or (dp_replicate N/(T S), dp_shard S, tp T) with --strategy
// hybrid --shard-group-size S. Each data-parallel rank takes its share of each global batch; the
// tensor-parallel ranks of one data-parallel coordinate take the same rows, so the data seen and
// the losses printed depend on neither size. --json prints one JSON object per step on rank 0,
// with `tp`, `dp` and `tp_collectives`: the tensor-parallel collectives the decoder layers issued
// in the step (not the embedding's, the head's or the loss's), counted by the library.
//
// Exit status: 0 trained; 2 a bad flag, --data file or model shape (nothing trained); 1 anything
// else, printed as "train_llama (rank R): <message>".
#include "examples/checkpoints.h"
#include "examples/corpus.h"
#include "examples/device_flag.h"
#include "examples/llama/hf.h"
#include "examples/llama/llama.h"
#include "examples/llama/train_pipelined.h"
#include "examples/optimizer_flag.h"
#include "examples/run_flags.h"
#include "examples/strategy_flags.h"
#include "fsdp/fsdp.h"
#include "programs/flags.h"
#include "programs/flops.h"
#include "programs/json_row.h"
#include "programs/profile.h"
#include "programs/program.h"

#include <unistd.h>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>

#ifndef FSDP_EXAMPLE_CORPUS
#define FSDP_EXAMPLE_CORPUS "examples/data/corpus.txt"
#endif

namespace {

struct Args : examples::RunFlags {
  int64_t n_kv_head = 0;     // 0: --n-head
  int64_t intermediate = 0;  // 0: 4 x --n-embd
  int64_t tp = 1;
  double lr = 1e-3;
  double weight_decay = 0.1;
  double clip = 0;
  std::string optimizer = "adamw";  // examples/optimizer_flag.h
  std::string profile;              // --profile DIR (programs/profile.h)
  bool tied = false;
  bool sequence_parallel = false;
  bool json = false;
  double peak_tflops = 0;  // 0: the device's by name (programs/flops.h), unknown on the CPU
  std::string data = FSDP_EXAMPLE_CORPUS;
  double max_data_mb = 64;
  std::string from_hf;          // a Hugging Face directory: the shape and the weights
  std::vector<int64_t> prompt;  // token ids for --logits-out
  std::string logits_out;       // safetensors file of the prompt's logits, before any step
  std::string export_hf;        // a directory to write in Hugging Face's layout after training
  std::string device = "cpu";
  examples::CheckpointFlags ckpt;
  // --pp P (examples/llama/train_pipelined.h)
  int64_t pp = 1;
  std::string pp_schedule = "1f1b";
  int64_t microbatches = 0;     // 0: --pp
  int64_t stages_per_rank = 0;  // 0: 2 for interleaved, else 1
  bool pp_schedule_dump = false;
  std::string pp_schedule_file;
};

const char* const kAbout =
    "  Trains a Llama with tensor parallelism and FSDP on a 2-D mesh (one process, or torchrun's ranks).\n";
const char* const kNotes =
    "  A Llama (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) with Hugging Face's names.\n"
    "  --tp T: tensor-parallel size; the data-parallel size is the world size over T (the mesh\n"
    "  (dp_shard N/T, tp T); with --strategy hybrid --shard-group-size S, (dp_replicate N/(T S), dp_shard S,\n"
    "  tp T)). The heads and --n-kv-head (default: the heads) must be divisible by T.\n"
    "  --sequence-parallel: between the tensor-parallel regions each rank holds --block-size / T positions\n"
    "  (all-gathers and reduce-scatters instead of the all-reduces; the norms' weight gradients all-reduced).\n"
    "  --intermediate: the MLP's width (default 4 x --n-embd); --tied: the head shares the embedding.\n"
    "  --batch-size is the global batch: each data-parallel rank takes B/(N/T) rows of it.\n"
    "  --from-hf DIR: the shape from DIR/config.json (LlamaForCausalLM; it overrides the shape flags) and the\n"
    "  weights from DIR/model.safetensors or its index, each rank reading only its parts.\n"
    "  --build-sharded: each decoder layer sharded as soon as it is built (fsdp::ShardingScope), with --pp\n"
    "  too (over each stage's ranks): the model never exists whole on a rank (not with --from-hf).\n"
    "  --prompt with --logits-out: rank 0 writes the prompt's logits (one fp32 tensor 'logits', [length,\n"
    "  vocabulary]) before any step; --steps 0 runs nothing else. --export-hf OUT: after training,\n"
    "  OUT/config.json and OUT/model.safetensors in Hugging Face's layout (from_pretrained loads it).\n"
    "  --save-dir DIR --save-every K: a sharded checkpoint (model, AdamW, sampler) every K steps, over the\n"
    "  whole mesh; --resume continues from DIR's latest on any mesh (another --tp, --pp or world size).\n"
    "  --pp P: a pipeline of P stages on the mesh (pp P, dp_shard D, tp T) of P x D x T ranks; each stage is\n"
    "  FSDP over its own D x T ranks (FusedAdamW), gathered once and reduced once per step.\n"
    "  --pp-schedule gpipe|1f1b|interleaved|zero-bubble, --microbatches M (default P;\n"
    "  each data-parallel share splits into M equal microbatches), --stages-per-rank V (interleaved, default 2);\n"
    "  --pp-schedule-file F: the action lists from a CSV (one line per rank, e.g. 0F0,0SEND_F0,...);\n"
    "  --pp-schedule-dump: print the lists and their simulated bubble, and exit. The lists are validated\n"
    "  before any step (a refusal exits 2 naming the action). --save-dir, --resume and --export-hf work with\n"
    "  --pp (one checkpoint of the whole model, loaded on any mesh), so do --from-hf, --prompt,\n"
    "  --build-sharded, --mixed-precision (fp16: one loss scaler over the stages) and, except with zero-bubble,\n"
    "  --activation-checkpointing. --async-save, --profile, --sequence-parallel, --strategy and --device cuda\n"
    "  are not supported with --pp yet (docs/pipeline.md).\n"
    "  Other flags as train_gpt's. Exit status: 0 trained, 2 bad flags, --data or shape, 1 other errors.\n";

fsdp::programs::Program g_program("train_llama");  // its name in messages, its rank once known
std::string who() {
  return g_program.who();
}
using fsdp::programs::usage_error;

Args parse(int argc, char** argv) {
  constexpr int64_t kIntMax = INT_MAX;
  constexpr double kMax = std::numeric_limits<double>::max();
  Args a;
  a.model.n_layer = 2;
  fsdp::programs::Flags flags("train_llama", kAbout);
  examples::add_run_flags(flags, a);
  // train_llama takes --steps 0: logits or an export of a --from-hf model only.
  flags.integer("--steps", a.steps, 0, std::numeric_limits<int64_t>::max(), "training steps")
      .integer("--n-kv-head", a.n_kv_head, 1, kIntMax, "key/value heads (default: --n-head)", "K")
      .integer("--intermediate", a.intermediate, 1, kIntMax, "the MLP's width (default 4 x --n-embd)", "I")
      .integer("--tp", a.tp, 1, kIntMax, "tensor-parallel size", "T")
      .toggle("--tied", a.tied, "the head shares the embedding")
      .toggle("--sequence-parallel", a.sequence_parallel, "sequence parallelism between the TP regions")
      .number("--lr", a.lr, 0, false, kMax, "learning rate", "LR")
      .number("--weight-decay", a.weight_decay, 0, true, kMax, "weight decay", "WD")
      .number("--clip", a.clip, 0, true, kMax, "max global gradient norm", "MAX_NORM")
      .toggle("--json", a.json, "one JSON row per step on rank 0, then a summary")
      .number("--peak-tflops", a.peak_tflops, 0, false, kMax, "each device's peak, for the MFU (default: by name)", "F")
      .text("--data", a.data, "the corpus, each byte a token", "FILE")
      .number("--max-data-mb", a.max_data_mb, 0, false, 1 << 20, "the most of --data read", "MB")
      .text("--from-hf", a.from_hf, "a Hugging Face directory: the shape and the weights", "DIR")
      .custom("--prompt", "1,5,9,...", "token ids for --logits-out",
              [&a](const std::string& list) {
                if (list.empty() || list.back() == ',') usage_error("--prompt '" + list + "' ends without a token id");
                a.prompt.clear();
                for (const auto id : fsdp::programs::parse_int_list("--prompt", list, 0)) a.prompt.push_back(id);
              })
      .text("--logits-out", a.logits_out, "rank 0 writes the prompt's logits here", "FILE.safetensors")
      .text("--export-hf", a.export_hf, "after training, the model in Hugging Face's layout", "OUT")
      .toggle("--reference-path", a.model.reference_path,
              "RMSNorm, rotary tables and GQA as before their fused kernels (for comparison)")
      .text("--profile", a.profile, "a trace of a few steps in DIR/trace.json, and their table", "DIR",
            /*non_empty=*/true);
  flags.integer("--pp", a.pp, 1, 511, "pipeline-parallel size", "P")
      .choice("--pp-schedule", a.pp_schedule, {"gpipe", "1f1b", "interleaved", "zero-bubble"},
              "the pipeline's schedule")
      .integer("--microbatches", a.microbatches, 1, 1 << 20, "microbatches per step with --pp (default --pp)", "M")
      .integer("--stages-per-rank", a.stages_per_rank, 1, 64, "stages per pipeline rank (interleaved: default 2)", "V")
      .text("--pp-schedule-file", a.pp_schedule_file, "the pipeline's action lists from a CSV file", "FILE")
      .toggle("--pp-schedule-dump", a.pp_schedule_dump, "print the schedule's action lists and bubble, and exit");
  examples::add_optimizer_flag(flags, a.optimizer, /*with_sgd=*/false);
  examples::add_device_flag(flags, a.device);
  a.ckpt.add_to(flags);
  flags.notes(kNotes).parse(argc, argv);
  examples::check_run_flags(a);
  a.ckpt.check();
  if (a.build_sharded && !a.from_hf.empty()) {
    usage_error(
        "--build-sharded with --from-hf: the Hugging Face weights are read into the whole model, which "
        "--build-sharded never builds; drop --build-sharded to load them");
  }
  if (!a.wrap.empty()) usage_error("--wrap is train_gpt's; train_llama's units are its decoder layers");
  if (a.prompt.empty() != a.logits_out.empty()) usage_error("--prompt and --logits-out go together");
  if (a.pp == 1 && !a.pp_schedule_dump &&
      (a.microbatches > 0 || a.stages_per_rank > 0 || !a.pp_schedule_file.empty())) {
    usage_error("--microbatches, --stages-per-rank and --pp-schedule-file need --pp P with P > 1");
  }
  if (a.pp > 1 && !a.pp_schedule_dump) {
    const std::pair<bool, const char*> unsupported[] = {{a.ckpt.async, "--async-save"},
                                                        {!a.profile.empty(), "--profile"},
                                                        {a.sequence_parallel, "--sequence-parallel"},
                                                        {a.model.checkpoint_every > 0 && a.pp_schedule == "zero-bubble",
                                                         "--activation-checkpointing with --pp-schedule zero-bubble "
                                                         "(its weight pass cannot run through a recompute)"},
                                                        {a.device != "cpu", "--device cuda"},
                                                        {a.strategy != "full", "--strategy"}};
    for (const auto& [given, flag] : unsupported) {
      if (given) usage_error(std::string(flag) + " is not supported with --pp yet (docs/pipeline.md)");
    }
  }
  examples::check_device_flag(a.device);
  // Where the results go, checked before any work (a fine-tune must not end in a path error).
  auto writable_dir = [](const std::string& d) { return ::access(d.empty() ? "." : d.c_str(), W_OK | X_OK) == 0; };
  if (!a.logits_out.empty()) {
    const std::string parent = std::filesystem::path(a.logits_out).parent_path().string();
    if (std::filesystem::is_directory(a.logits_out) || !writable_dir(parent)) {
      usage_error("--logits-out " + a.logits_out + ": not a file in a writable directory");
    }
  }
  if (!a.export_hf.empty()) {
    namespace fs = std::filesystem;
    const fs::path out(a.export_hf);
    const bool ok =
        fs::exists(out) ? fs::is_directory(out) && writable_dir(a.export_hf) : writable_dir(out.parent_path().string());
    if (!ok) usage_error("--export-hf " + a.export_hf + ": not a writable directory, nor one that can be made");
  }
  return a;
}

llama::Config config_of(const Args& a) {
  llama::Config c;
  c.block_size = a.model.block_size;
  c.n_layer = a.model.n_layer;
  c.n_head = a.model.n_head;
  c.n_kv_head = a.n_kv_head;
  c.n_embd = a.model.n_embd;
  c.intermediate = a.intermediate;
  c.tie_word_embeddings = a.tied;
  c.checkpoint_every = a.model.checkpoint_every;
  c.sequence_parallel = a.sequence_parallel;
  c.reference_path = a.model.reference_path;
  return c;
}

int run(const Args& args) {
  llama::Config cfg = config_of(args);
  if (!args.from_hf.empty()) {
    cfg = llama::hf::read_config(args.from_hf, args.model.block_size);
    cfg.checkpoint_every = args.model.checkpoint_every;
    cfg.sequence_parallel = args.sequence_parallel;
    cfg.reference_path = args.model.reference_path;
  }
  if (args.sequence_parallel && !args.prompt.empty() && static_cast<int64_t>(args.prompt.size()) % args.tp != 0) {
    usage_error("--sequence-parallel splits the --prompt's " + std::to_string(args.prompt.size()) +
                " tokens over --tp " + std::to_string(args.tp) + ", which does not divide them");
  }
  for (int64_t t : args.prompt) {
    if (t >= cfg.vocab_size) {
      usage_error("--prompt token " + std::to_string(t) + " is outside the vocabulary [0, " +
                  std::to_string(cfg.vocab_size) + ")");
    }
  }
  const std::string shape = llama::shape_error(cfg, args.tp);
  if (!shape.empty()) usage_error(shape);
  std::optional<std::chrono::milliseconds> timeout;
  if (args.timeout_s) timeout = std::chrono::milliseconds(std::max<int64_t>(1, std::llround(*args.timeout_s * 1000)));
  if (args.pp > 1 || args.pp_schedule_dump) {
    llama::PipelinedRun run;
    run.cfg = cfg;
    run.pp = args.pp;
    run.tp = args.tp;
    run.schedule = args.pp_schedule;
    run.schedule_file = args.pp_schedule_file;
    run.microbatches = args.microbatches > 0 ? args.microbatches : args.pp;
    run.stages_per_rank = args.stages_per_rank > 0 ? args.stages_per_rank : args.pp_schedule == "interleaved" ? 2 : 1;
    run.steps = args.steps;
    run.batch_size = args.batch_size;
    run.seed = args.seed;
    run.lr = args.lr;
    run.weight_decay = args.weight_decay;
    run.clip = args.clip;
    run.json = args.json;
    run.data = args.data;
    run.max_data_mb = args.max_data_mb;
    run.timeout = timeout;
    run.mixed_precision = examples::mixed_precision_policy(args);
    run.fp16 = args.mixed_precision == "fp16";
    run.ckpt = args.ckpt;
    run.export_hf = args.export_hf;
    run.build_sharded = args.build_sharded;
    run.from_hf = args.from_hf;
    run.prompt = args.prompt;
    run.logits_out = args.logits_out;
    if (args.pp_schedule_dump) {
      llama::dump_schedule(run);
      return 0;
    }
    if (args.batch_size % run.microbatches != 0) {
      usage_error("--batch-size " + std::to_string(args.batch_size) + " does not split into --microbatches " +
                  std::to_string(run.microbatches) + " equal microbatches");
    }
    return llama::train_pipelined(run, g_program);
  }
  const int64_t T = cfg.block_size;
  auto data = corpus::load(args.data, args.max_data_mb, T);
  const int64_t samples = corpus::samples(data, T);
  if (samples < args.batch_size) {
    corpus::data_error(args.data, "has " + std::to_string(samples) + " windows of --block-size + 1 tokens, fewer " +
                                      "than one global batch (--batch-size " + std::to_string(args.batch_size) + ")");
  }
  fsdp::InitOptions init;
  if (timeout) init.timeout(*timeout);
  fsdp::programs::StepProfiler profiler(args.profile);  // before the group: a bad DIR fails alone
  auto world = fsdp::init_process_group(init);
  const int rank = world->getRank(), W = world->getSize();
  g_program.set_rank(rank);
  const torch::Device device = examples::training_device(args.device);
  if (W % args.tp != 0) {
    usage_error("--tp " + std::to_string(args.tp) + " does not divide the " + std::to_string(W) +
                " ranks: the data-parallel size is the world size over --tp");
  }
  const int dp = W / static_cast<int>(args.tp);
  const fsdp::ShardingStrategy strategy = gpt::strategy_flags().at(args.strategy);
  std::vector<fsdp::MeshDim> dims{{fsdp::kShardDim, dp}, {fsdp::kTensorDim, static_cast<int>(args.tp)}};
  if (strategy == fsdp::ShardingStrategy::kHybridShard) {
    const int S = args.shard_group_size > 0 ? args.shard_group_size : std::max(1, dp / 2);
    if (dp % S != 0) {
      usage_error("--shard-group-size " + std::to_string(S) + " does not divide the " + std::to_string(dp) +
                  " data-parallel ranks");
    }
    dims = {{fsdp::kReplicateDim, dp / S}, {fsdp::kShardDim, S}, {fsdp::kTensorDim, static_cast<int>(args.tp)}};
  }
  fsdp::DeviceMesh mesh(world, dims);
  if (args.batch_size % dp != 0) {
    usage_error("--batch-size " + std::to_string(args.batch_size) + " cannot be split over the " + std::to_string(dp) +
                " data-parallel ranks into equal shares; " + fsdp::data::divisible_sizes(args.batch_size, dp));
  }
  auto options =
      fsdp::FullyShardOptions()
          .prefetch(args.prefetch)
          .strategy(strategy == fsdp::ShardingStrategy::kHybridShard ? fsdp::ShardingStrategy::kFullShard : strategy)
          .mixed_precision(examples::mixed_precision_policy(args));
  if (timeout) options.timeout(*timeout);

  fsdp::tp::Group blocks(mesh), vocab(mesh);  // one set of ranks, counted apart
  torch::manual_seed(args.seed);
  // With --build-sharded each decoder layer is sharded (its tensor-parallel part over the
  // data-parallel ranks) as soon as it is built, and moves to the device then: the model never
  // exists whole on a rank. The weights are the same either way (each drawn from its own name).
  auto model = args.build_sharded ? [&] {
    fsdp::ShardingScope scope(mesh, fsdp::FullyShardOptions(options).device(device));
    llama::LlamaForCausalLM net(cfg, blocks, vocab);
    return fsdp::fully_shard(net, scope);
  }()
                                  : [&] {
                                      llama::LlamaForCausalLM net(cfg, blocks, vocab);
                                      if (!args.from_hf.empty()) llama::hf::load_weights(args.from_hf, *net);
                                      net->to(device);
                                      return fsdp::fully_shard(net, mesh, options);
                                    }();
  // Ψ: the full model's parameters (every tensor-parallel part once), of which those tensor
  // parallelism splits (the rest, the norms, every tp rank holds whole).
  int64_t n_params = 0, n_split = 0;
  for (const auto& s : model.shard_specs()) {
    int64_t n = 1;
    for (int64_t d : s.global_shape) n *= d;
    n_params += n * (s.tp.split() ? s.tp.parts : 1);
    if (s.tp.split() || args.tp == 1) n_split += n * (s.tp.split() ? s.tp.parts : 1);
  }
  const fsdp::programs::TransformerShape flops_shape = llama::flops_shape(cfg, n_params);
  const double peak_tflops = fsdp::programs::resolve_peak_tflops(args.peak_tflops, device);
  std::unique_ptr<torch::optim::Optimizer> opt =
      examples::make_optimizer(args.optimizer, model, args.lr, args.weight_decay);
  fsdp::optim::ShardedGradScaler scaler(model,
                                        fsdp::optim::GradScalerOptions().enabled(args.mixed_precision == "fp16"));
  // --resume: the latest checkpoint's seed (the sampler's), then the model, AdamW, the generators
  // and the sampler's place, on whatever mesh this run has (the checkpoint records whole tensors).
  int64_t first_step = 0;
  uint64_t seed = args.seed;
  examples::Checkpoints checkpoints(args.ckpt);
  const std::string resume_from = checkpoints.resume_from(seed, rank, who());
  fsdp::data::DistributedSampler sampler(samples, mesh.coordinate(fsdp::kDataDim), dp,
                                         fsdp::data::SamplerOptions(args.batch_size).seed(seed));
  if (!resume_from.empty()) {
    const auto res = fsdp::checkpoint::load(resume_from, model, *opt,
                                            fsdp::checkpoint::LoadOptions().sampler(&sampler).in_place(true));
    first_step = res.step;
    // What the load read, over every rank, against what it needed.
    if (rank == 0) examples::Checkpoints::print_resumed(res, mesh.shape_text(), args.json, who());
    examples::Checkpoints::restore_loss_scale(scaler, res.metadata, rank, who());
  }
  if (rank == 0 && !args.json) {
    std::cout << "train_llama: " << W << " rank(s) as mesh " << mesh.shape_text() << ", " << n_params << " parameters, "
              << cfg.n_layer << " layers, " << cfg.n_head << " heads (" << cfg.kv_heads() << " key-value), width "
              << cfg.n_embd << ", MLP " << cfg.ffn() << (cfg.tie_word_embeddings ? ", tied" : "") << "\n";
  }
  if (!args.prompt.empty()) {
    torch::NoGradGuard no_grad;
    auto ids = torch::tensor(args.prompt, torch::kLong).unsqueeze(0).to(device);
    auto logits = fsdp::tp::gather_from_region(model(ids), vocab);  // [1, P, V] on every tp rank
    if (rank == 0) llama::hf::write_logits(args.logits_out, logits.squeeze(0));
  }
  double total_ms = 0;  // steps after the first
  for (int64_t step = first_step; step < args.steps; ++step) {
    profiler.begin(fsdp::programs::profiled_step(step - first_step, args.steps - first_step),
                   "step " + std::to_string(step), device);
    opt->zero_grad();
    blocks.reset_comm_stats();
    vocab.reset_comm_stats();
    model.reset_comm_stats();
    fsdp::memory::reset_peak(device);
    const auto t0 = std::chrono::steady_clock::now();
    auto share = sampler.next_share();
    if (!share) share = sampler.next_share();
    const auto xy = corpus::batch(data, share->indices, T);
    torch::Tensor loss;
    {
      fsdp::programs::Phase phase("fsdp.forward");
      loss = fsdp::tp::vocab_parallel_cross_entropy(model(xy.first.to(device)), xy.second.to(device),
                                                    vocab);  // no full logits on any rank
    }
    {
      fsdp::programs::Phase phase("fsdp.backward");
      scaler.scale(loss).backward();
    }
    scaler.unscale_(*opt);
    const double grad_norm = scaler.found_inf() ? std::nan("")
                             : args.clip > 0    ? fsdp::optim::clip_grad_norm(model, args.clip, 2.0, true)
                                                : fsdp::optim::grad_norm(model, 2.0, true);
    {
      fsdp::programs::Phase phase("fsdp.optimizer");
      scaler.step(*opt);
      scaler.update();
    }
    examples::synchronize(device);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    profiler.end(!fsdp::programs::profiled_step(step + 1 - first_step, args.steps - first_step), rank,
                 args.json ? std::cerr : std::cout);
    const fsdp::CommStats tps = blocks.comm_stats();
    // Model state at the optimizer step (parameter shards, gradients, AdamW) and the allocator's
    // peak, each the largest over the ranks; what the step sent (fsdp: the data-parallel
    // all-gathers and reduce-scatters; tp: the blocks', then the embedding's, head's and loss's).
    auto mem = torch::tensor(
        {fsdp::optim::state_bytes(model.parameters(), opt.get()).total(), fsdp::memory::stats(device).peak_bytes},
        torch::kLong);
    fsdp::all_reduce(world, mem, c10d::ReduceOp::MAX);
    if (step > first_step) total_ms += ms;
    auto mean = loss.detach().to(torch::kDouble).reshape({1});
    fsdp::all_reduce(mesh.group(fsdp::kDataDim), mean);
    const double l = mean.item<double>() / dp;
    if (rank == 0) {
      const auto speed = fsdp::programs::step_throughput(flops_shape, T, args.batch_size * T, ms, peak_tflops, W);
      if (args.json) {
        fsdp::programs::JsonRow()
            .add("step", step)
            .add("loss", l, "%.9g")
            .add("grad_norm", grad_norm, "%.9g")
            .add("step_ms", ms, "%.3f")
            .add("flops_per_token", speed.flops_per_token, "%.17g")
            .add("tokens_per_s", speed.tokens_per_s, "%.6g")
            .add("mfu", speed.mfu, "%.6g")
            .add("world_size", W)
            .add("tp", args.tp)
            .add("dp", dp)
            .add("tp_collectives", tps.all_gathers + tps.reduce_scatters + tps.all_reduces)
            .add("tp_elements", tps.elements)
            .add("tp_vocab_elements", vocab.comm_stats().elements)
            .add("fsdp_elements", model.comm_stats().elements)
            .add("state_bytes", mem[0].item<int64_t>())
            .add("peak_bytes", mem[1].item<int64_t>())
            .add("params", n_params)
            .add("epoch", share->epoch)
            .add("samples_consumed", sampler.state().samples_consumed)
            .print();
      } else {
        std::printf("step %4lld | loss %.4f | grad norm %.4g | %8.1f ms | %lld tensor-parallel collectives\n",
                    static_cast<long long>(step), l, grad_norm, ms,
                    static_cast<long long>(tps.all_gathers + tps.reduce_scatters + tps.all_reduces));
      }
      std::fflush(stdout);
    }
    if (!std::isfinite(l)) {
      throw std::runtime_error("the loss of step " + std::to_string(step) +
                               " is not finite: training diverged. Lower --lr, or clip with --clip MAX_NORM.");
    }
    // fp16: the loss scale and its growth count go with the checkpoint (grad_scaler.*).
    fsdp::checkpoint::Metadata meta = scaler.state_dict();
    meta.insert({{"seed", std::to_string(seed)},
                 {"global_batch", std::to_string(args.batch_size)},
                 {"example", "train_llama"}});
    const std::string saved = checkpoints.after_step(step, model, *opt, sampler, meta);
    if (rank == 0 && !saved.empty() && !args.json) std::cerr << who() << ": " << saved << "\n";
  }
  checkpoints.finish();
  if (!args.export_hf.empty()) {
    llama::hf::export_model(args.export_hf, model, mesh, cfg);
    if (rank == 0 && !args.json) std::cout << "train_llama: exported to " << args.export_hf << "\n";
  }
  if (rank == 0 && args.json) {
    // The model state's formula, 16 bytes per parameter (fp32 parameter, gradient, two AdamW
    // moments) over the ranks that split it: 16Ψ/(dp tp), and exactly, the parameters tensor
    // parallelism does not split counted whole on each tp rank.
    const double T_ = static_cast<double>(args.tp);
    const double mean_ms =
        args.steps - first_step > 1 ? total_ms / static_cast<double>(args.steps - first_step - 1) : 0.0;
    fsdp::programs::JsonRow()
        .add("summary", true)
        .add("world_size", W)
        .add("tp", args.tp)
        .add("dp", dp)
        .add("mesh", mesh.shape_text())
        .add("params", n_params)
        .add("params_split", n_split)
        .add("mean_step_ms", mean_ms, "%.3f")
        .add("formula_state_bytes", 16.0 * static_cast<double>(n_params) / (dp * T_), "%.1f")
        .add("formula_state_bytes_exact",
             16.0 * (static_cast<double>(n_split) / T_ + static_cast<double>(n_params - n_split)) / dp, "%.1f")
        .print();
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::memory::enable_cpu_counting();
  return g_program.main([&] {
    const Args args = parse(argc, argv);
    g_program.set_json_errors(args.json);
    return run(args);
  });
}
