// Trains a small GPT with fully sharded data parallelism.
//
//   build/examples/train_gpt --steps 20                                  # one process
//   torchrun --no-python --nproc-per-node 2 build/examples/train_gpt     # two ranks
//
// Every rank takes its share of each global batch, so the data seen (and the losses printed) do
// not depend on the number of ranks. --json prints one JSON object per step on rank 0, then one
// summary object with every rank's memory and mean step time. A step's peak is split into the model
// state at its own peak (state_peak_bytes), the library's buffers (buffer_bytes) and the rest
// (other_bytes: activations and temporaries, at least), each the largest over ranks.
//
// Exit status: 0 trained; 2 a bad flag or --data file (nothing trained); 1 anything else, such as
// a loss or gradient norm that is no longer finite, or an error from the library (a collective
// timed out, a peer died), printed as "train_gpt (rank R): <message>".
#include "examples/checkpoints.h"
#include "examples/corpus.h"
#include "examples/device_flag.h"
#include "examples/gpt.h"
#include "examples/optimizer_flag.h"
#include "examples/outer_step.h"
#include "examples/run_flags.h"
#include "examples/strategy_flags.h"
#include "fsdp/fsdp.h"
#include "programs/flags.h"
#include "programs/flops.h"
#include "programs/json_row.h"
#include "programs/profile.h"
#include "programs/program.h"

#include <torch/nn/functional/loss.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>

#ifndef FSDP_EXAMPLE_CORPUS
#define FSDP_EXAMPLE_CORPUS "examples/data/corpus.txt"
#endif

namespace {

// The flags shared with fsdp_bench (model, batch, steps, seed, prefetch, strategy, ...) are
// examples/run_flags.h's; these are train_gpt's own.
struct Args : examples::RunFlags {
  double lr = 1e-3;
  double weight_decay = 0.1;
  std::string optimizer = "adamw";  // examples/optimizer_flag.h
  std::string data = FSDP_EXAMPLE_CORPUS;
  double max_data_mb = 64;  // bound on the corpus read (each byte becomes an 8-byte token)
  bool json = false;
  int64_t grad_accum = 0;  // micro-batches per step (0: from --max-rows)
  int64_t max_rows = 0;    // the most rows one rank runs at once (0: its whole share)
  bool no_sync = false;    // communicate only in the last micro-batch
  double clip = 0;         // max global gradient norm (0: no clipping)
  double peak_tflops = 0;  // each device's peak for the MFU; 0: by its name (programs/flops.h)
  std::string device = "cpu";
  std::string profile;  // --profile DIR (programs/profile.h)
  examples::CheckpointFlags ckpt;
  examples::OuterFlags outer;  // --local-sgd / --diloco
};

const char* const kAbout =
    "  Trains a small GPT with fully sharded data parallelism (one process, or the ranks of torchrun).\n";
const char* const kNotes =
    "  --strategy: full sharding (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), optimizer state only (ZeRO-1),\n"
    "  replicated (DDP), or hybrid: full sharding inside groups of S consecutive ranks (default N/2).\n"
    "  --build-sharded: shard each block while the model is built (a model larger than one rank); with\n"
    "  --device cuda each block moves to the GPU as it is built.\n"
    "  --activation-checkpointing [K]: blocks K, 2K, ... (default every one) recompute their forward in backward.\n"
    "  --wrap: units are the token embedding, each block, the final norm with the head (torchtitan, default),\n"
    "  or the blocks alone (the root keeping the rest).\n"
    "  --batch-size is the global batch: each of the N ranks takes B/N rows of it (fsdp::data's sampler:\n"
    "  each epoch visits every window of the corpus once, in an order set by --seed), in M micro-batches with\n"
    "  --grad-accum M, or in as few as keep each at most R rows with --max-rows R (fsdp::data::plan_batch: the\n"
    "  same global batch and update on any number of ranks); --no-sync: reduce gradients only after the last.\n"
    "  --data: a regular file of at most --max-data-mb MiB (default 64), each byte a token.\n"
    "  --clip 0 (default) does not clip; the gradient norm is checked every step either way.\n"
    "  --mixed-precision: gather and compute in bf16 or fp16, fp32 master weights, gradients reduced in\n"
    "  fp32; fp16 scales the loss (a step with an inf or NaN gradient on any rank is skipped).\n"
    "  --timeout: bound on start-up and every collective, in seconds (default: $FSDP_TIMEOUT, else 600).\n"
    "  --save-dir DIR --save-every K: a sharded checkpoint (model, optimizer, generators, seed and the\n"
    "  sampler's state) under DIR after every K steps, every rank writing its part; --resume: continue from\n"
    "  DIR's latest checkpoint, on any number of ranks and strategy, taking its step, seed and data\n"
    "  position whatever the flags say (none there: start at step 0). --steps is the last step + 1.\n"
    "  --async-save: save in the background while training goes on; a save due while the previous one is\n"
    "  still being written is skipped on every rank (counted in the summary). --keep-last N: keep N checkpoints.\n"
    "  --direct-io: write the checkpoints with O_DIRECT (no page-cache copy: less CPU taken from training).\n"
    "  --local-sgd H / --diloco H (with --strategy hybrid): each hybrid group is a replica that trains alone;\n"
    "  every H steps LocalSGD averages the replicas' parameters, DiLoCo applies an outer Nesterov SGD (--outer-lr,\n"
    "  default 0.7; --outer-momentum, default 0.9, 0: plain SGD) to their mean change; --fragments F: F groups of\n"
    "  units synchronized in turn, one every H/F steps; --overlap: the exchange in flight during the next step,\n"
    "  applied after it (one step stale). The loss, norm and memory printed are replica 0's; every\n"
    "  JSON step row carries replica_comm_bytes, the bytes one replica sent to the others in that step.\n"
    "  Exit status: 0 trained, 2 bad flags or --data, 1 other errors (a non-finite loss or gradient norm).\n";

// Wall-clock seconds at main()'s entry, for --json's start row (the recovery of an elastic run).
double g_t_main = 0;
double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
fsdp::programs::Program g_program("train_gpt");  // its name in messages, its rank once known
std::string who() {
  return g_program.who();
}
using fsdp::programs::usage_error;

Args parse(int argc, char** argv) {
  Args a;
  fsdp::programs::Flags flags("train_gpt", kAbout);
  examples::add_run_flags(flags, a);
  flags.number("--lr", a.lr, 0, false, std::numeric_limits<double>::max(), "learning rate", "LR")
      .number("--weight-decay", a.weight_decay, 0, true, std::numeric_limits<double>::max(), "weight decay", "WD")
      .text("--data", a.data, "the corpus, each byte a token", "FILE")
      .number("--max-data-mb", a.max_data_mb, 0, false, 1 << 20, "the most of --data read", "MB")
      .integer("--grad-accum", a.grad_accum, 1, std::numeric_limits<int64_t>::max(), "micro-batches per step", "M")
      .integer("--max-rows", a.max_rows, 1, std::numeric_limits<int64_t>::max(), "the most rows one rank runs at once",
               "R")
      .toggle("--no-sync", a.no_sync, "reduce gradients only after the last micro-batch")
      .number("--clip", a.clip, 0, true, std::numeric_limits<double>::max(), "max global gradient norm", "MAX_NORM")
      .toggle("--json", a.json, "one JSON row per step on rank 0, then a summary")
      .number("--peak-tflops", a.peak_tflops, 0, false, std::numeric_limits<double>::max(),
              "each device's peak, for the MFU (default: by name)", "F")
      .toggle("--reference-path", a.model.reference_path, "attention by hand, as before SDPA (for comparison)")
      .text("--profile", a.profile, "a trace of a few steps in DIR/trace.json, and their table", "DIR",
            /*non_empty=*/true);
  examples::add_optimizer_flag(flags, a.optimizer, /*with_sgd=*/true);
  examples::add_device_flag(flags, a.device);
  a.ckpt.add_to(flags);
  a.outer.add_to(flags);
  flags.notes(kNotes).parse(argc, argv);
  examples::check_run_flags(a);
  a.model.wrap = examples::wrap_of(a, gpt::Wrap::kTorchtitan);
  if (a.grad_accum > 0 && a.max_rows > 0) {
    usage_error(
        "--grad-accum and --max-rows both set the micro-batches: pass one (--max-rows keeps the global batch on "
        "any number of ranks)");
  }
  examples::check_device_flag(a.device);
  a.ckpt.check();
  a.outer.check(a.strategy == "hybrid");
  return a;
}

std::string mib(int64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(b) / (1024.0 * 1024.0));
  return buf;
}

int run(const Args& args) {
  const int64_t T = args.model.block_size;
  // Before the group: a bad file fails alone, at once.
  auto data = corpus::load(args.data, args.max_data_mb, T);
  const int64_t samples = corpus::samples(data, T);
  if (samples < args.batch_size) {
    corpus::data_error(args.data, "has " + std::to_string(samples) + " windows of --block-size + 1 = " +
                                      std::to_string(T + 1) + " tokens, fewer than one global batch (--batch-size " +
                                      std::to_string(args.batch_size) + "); lower --batch-size or --block-size");
  }
  std::optional<std::chrono::milliseconds> timeout;
  if (args.timeout_s) {
    timeout = std::chrono::milliseconds(std::max<int64_t>(1, std::llround(*args.timeout_s * 1000.0)));
  }
  fsdp::InitOptions init;
  if (timeout) init.timeout(*timeout);
  fsdp::programs::StepProfiler profiler(args.profile);  // before the group: a bad DIR fails alone
  auto pg = fsdp::init_process_group(init);
  const double t_group = wall_seconds();
  const int rank = pg->getRank(), world = pg->getSize();
  g_program.set_rank(rank);
  const torch::Device device = examples::training_device(args.device);
  // Each step's global batch: this rank's share of it, in K micro-batches of `micro` rows.
  if (args.batch_size % world != 0) {
    usage_error("--batch-size " + std::to_string(args.batch_size) + " cannot be split over the " +
                std::to_string(world) + " ranks into equal shares; " +
                fsdp::data::divisible_sizes(args.batch_size, world));
  }
  const int64_t share_rows = args.batch_size / world;
  if (args.grad_accum > 0 && share_rows % args.grad_accum != 0) {
    usage_error("each rank's share of --batch-size " + std::to_string(args.batch_size) + " (" +
                std::to_string(share_rows) + " rows on " + std::to_string(world) +
                " ranks) is not divisible by --grad-accum " + std::to_string(args.grad_accum) +
                "; pass --max-rows R instead to keep micro-batches of at most R rows on any number of ranks");
  }
  const int64_t max_rows = args.grad_accum > 0 ? share_rows / args.grad_accum
                           : args.max_rows > 0 ? args.max_rows
                                               : share_rows;
  const fsdp::data::BatchPlan plan = fsdp::data::plan_batch(args.batch_size, world, max_rows);
  const int64_t K = plan.accumulation, micro = plan.micro_batch;

  const fsdp::ShardingStrategy strategy = gpt::strategy_flags().at(args.strategy);
  const int group = args.shard_group_size > 0 ? args.shard_group_size : std::max(1, world / 2);
  if (strategy == fsdp::ShardingStrategy::kHybridShard && (group > world || world % group != 0)) {
    usage_error("--shard-group-size " + std::to_string(group) + " does not divide the " + std::to_string(world) +
                " ranks (hybrid's groups must tile them)");
  }
  auto options = fsdp::FullyShardOptions()
                     .prefetch(args.prefetch)
                     .strategy(strategy)
                     .shard_group_size(group)
                     .bucket_bytes(static_cast<int64_t>(args.bucket_mb * 1024 * 1024))
                     .mixed_precision(examples::mixed_precision_policy(args));
  if (timeout) options.timeout(*timeout);
  torch::manual_seed(args.seed);
  // With --build-sharded each block is sharded as soon as it is constructed, so the whole model
  // never exists on one rank; the weights are the same either way (same seed, same draws). The
  // blocks are drawn on the CPU and each moves to the device as it is built (options.device).
  auto model = args.build_sharded ? [&] {
    fsdp::ShardingScope scope(pg, fsdp::FullyShardOptions(options).device(device));
    return fsdp::fully_shard(gpt::make_gpt<true>(args.model), scope);
  }()
                                  : fsdp::fully_shard(gpt::make_gpt_on<true>(args.model, device), pg, options);
  const int64_t n_params = model.num_parameters();  // Ψ: elements of the full model
  const fsdp::programs::TransformerShape flops_shape = gpt::flops_shape(args.model, n_params);
  const double peak_tflops = fsdp::programs::resolve_peak_tflops(args.peak_tflops, device);

  std::unique_ptr<torch::optim::Optimizer> opt =
      examples::make_optimizer(args.optimizer, model, args.lr, args.weight_decay);

  // --local-sgd / --diloco: the step goes through the outer optimizer, and what is logged each step
  // is summed over this replica's ranks only (metrics_pg), so that no collective of a step spans
  // the replicas; without them, over every rank.
  examples::OuterStep outer(args.outer, model, *opt);
  const int replicas = strategy == fsdp::ShardingStrategy::kHybridShard ? world / group : 1;
  auto metrics_pg = pg;
  if (args.outer.on()) {
    std::vector<int> members;
    for (int i = 0; i < group; ++i) members.push_back(rank / group * group + i);
    metrics_pg = fsdp::new_subgroup(pg, members, "train_gpt/replica" + std::to_string(rank / group));
  }
  const int metrics_world = metrics_pg->getSize();

  // fp16's range needs the loss scaled; bf16 has fp32's (the scaler is then off and does nothing).
  fsdp::optim::ShardedGradScaler scaler(model,
                                        fsdp::optim::GradScalerOptions().enabled(args.mixed_precision == "fp16"));

  // --resume: the checkpoint's step, seed and sampler state, whatever the flags say; the model, the
  // optimizer and the generators from it. Its seed is read first: the sampler is built with it.
  int64_t first_step = 0;
  uint64_t seed = args.seed;
  examples::Checkpoints checkpoints(args.ckpt);
  const std::string resume_from = checkpoints.resume_from(seed, rank, who());
  // The order of the corpus's windows, the same on any number of ranks; each step takes the next
  // global batch of it, this rank its share.
  fsdp::data::DistributedSampler sampler(samples, rank, world, fsdp::data::SamplerOptions(args.batch_size).seed(seed));
  if (!resume_from.empty()) {
    // In place: the fresh model holds nothing to keep should the load fail (the run exits then).
    const auto res = fsdp::checkpoint::load(resume_from, model, *opt,
                                            fsdp::checkpoint::LoadOptions().sampler(&sampler).in_place(true));
    first_step = res.step;
    examples::Checkpoints::restore_loss_scale(scaler, res.metadata, rank, who());
    const auto batch = res.metadata.find("global_batch");
    if (rank == 0) {
      std::cerr << who() << ": resumed from '" << res.path << "' (saved by " << res.saved_world_size
                << " rank(s)) at step " << first_step << ", seed " << seed << ", "
                << fsdp::data::to_string(sampler.state()) << "\n";
      if (!res.replicas.empty()) std::cerr << who() << ": replicas training apart: " << res.replicas << "\n";
      if (batch != res.metadata.end() && batch->second != std::to_string(args.batch_size)) {
        std::cerr << who() << ": warning: saved with --batch-size " << batch->second << ", resumed with "
                  << args.batch_size << ": the updates, and so the loss curve, are not the saved run's\n";
      }
    }
  }

  if (args.json) {
    // When this process started, joined its group and was ready to train (after a resume's load),
    // in wall-clock seconds, and when the last rank started (the group waits for it): with the
    // launcher's log, where an elastic restart's time goes.
    at::Tensor started = at::zeros({world}, at::kDouble);
    started[rank] = g_t_main;
    fsdp::all_reduce(pg, started);
    const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
    if (rank == 0) {
      fsdp::programs::JsonRow()
          .add("start", true)
          .add("world_size", world)
          .add("restart_count", restart != nullptr && *restart != '\0' ? std::atoll(restart) : 0LL)
          .add("first_step", first_step)
          .add("t_main", g_t_main, "%.6f")
          .add("t_main_last", started.max().item<double>(), "%.6f")
          .add("t_group", t_group, "%.6f")
          .add("t_ready", wall_seconds(), "%.6f")
          .print();
    }
  }
  if (rank == 0 && !args.json) {
    std::cout << "train_gpt: " << world << " rank(s), " << n_params << " parameters, " << args.model.n_layer
              << (args.model.wrap == gpt::Wrap::kTorchtitan ? " blocks (units: wte, each block, ln_f+lm_head)"
                                                            : " blocks (units: each block)")
              << ", " << fsdp::data::to_string(plan) << " of " << T << " tokens (" << samples << " windows per epoch"
              << (args.no_sync ? ", no sync" : "") << "), " << examples::optimizer_label(args.optimizer) << " lr "
              << args.lr << (args.clip > 0 ? ", clip " + std::to_string(args.clip) : "") << ", prefetch "
              << args.prefetch << ", strategy " << fsdp::to_string(strategy)
              << (strategy == fsdp::ShardingStrategy::kHybridShard ? " (groups of " + std::to_string(group) + ")" : "")
              << (args.mixed_precision.empty() ? "" : ", mixed precision " + args.mixed_precision + " (fp32 master)")
              << (args.model.checkpoint_every > 0
                      ? ", activation checkpointing every " + std::to_string(args.model.checkpoint_every) + " block(s)"
                      : "")
              << (timeout ? ", timeout " + std::to_string(timeout->count()) + " ms" : "") << "\n";
  }

  int64_t last_peak = 0, last_state = 0;
  double total_ms = 0;
  for (int64_t step = first_step; step < args.steps; ++step) {
    profiler.begin(fsdp::programs::profiled_step(step - first_step, args.steps - first_step),
                   "step " + std::to_string(step), device);
    opt->zero_grad();
    fsdp::memory::reset_peak(device);
    model.track_state_peak(true);
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t replica_bytes_before = model.comm_stats().replica_bytes;

    // This rank's share of the step's global batch (a step never spans two epochs: at an epoch's
    // end, the next epoch's first global batch).
    auto share = sampler.next_share();
    if (!share) share = sampler.next_share();
    auto loss = torch::zeros({}, torch::dtype(torch::kDouble).device(device));  // this rank's mean over its rows
    for (int64_t m = 0; m < K; ++m) {
      const std::vector<int64_t> rows(share->indices.begin() + m * micro, share->indices.begin() + (m + 1) * micro);
      const auto xy = corpus::batch(data, rows, T);
      model.set_requires_gradient_sync(!args.no_sync || m == K - 1);
      torch::Tensor l;
      {
        fsdp::programs::Phase phase("fsdp.forward");
        auto logits = model(xy.first.to(device));
        l = torch::nn::functional::cross_entropy(logits.flatten(0, 1), xy.second.to(device).flatten()) /
            static_cast<double>(K);
      }
      {
        fsdp::programs::Phase phase("fsdp.backward");
        scaler.scale(l).backward();
      }
      loss += l.detach().to(torch::kDouble);
    }
    // fp16: the gradients unscaled; an overflow on any rank skips this step on all of them (the
    // scale backs off), as the first steps of an fp16 run often do.
    scaler.unscale_(*opt);
    // The global gradient norm, every step: a NaN or infinite one stops training on every rank
    // (the same reduced value everywhere), naming this rank's first non-finite gradient.
    const double grad_norm = scaler.found_inf() ? std::nan("")
                             : args.clip > 0    ? fsdp::optim::clip_grad_norm(model, args.clip, 2.0, true)
                                                : fsdp::optim::grad_norm(model, 2.0, true);
    {
      fsdp::programs::Phase phase("fsdp.optimizer");
      outer.step([&] { scaler.step(*opt); });
      scaler.update();
    }

    // Model state at the optimizer step: sharded parameters, gradients, optimizer state.
    const auto at_step = fsdp::optim::state_bytes(model.parameters(), opt.get());
    // DiLoCo's outer state (global shards, outer momentum) is model state too.
    const int64_t outer_state =
        outer.diloco() == nullptr
            ? 0
            : fsdp::optim::state_bytes(outer.diloco()->global_shards(), &outer.diloco()->outer_optimizer()).total();
    const int64_t state = at_step.total() + outer_state, peak = fsdp::memory::stats(device).peak_bytes;
    // The peak split: model state at its own peak, the library's buffers, the rest (activations
    // and temporaries; a lower bound, as the state may be below its peak at the peak's moment).
    const int64_t state_peak = std::max(model.state_peak_bytes() + at_step.optimizer, state);
    const int64_t buffers = model.buffer_cache_stats().cached_bytes;
    model.track_state_peak(false);
    examples::synchronize(device);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (step > first_step) total_ms += ms;
    profiler.end(!fsdp::programs::profiled_step(step + 1 - first_step, args.steps - first_step), rank,
                 args.json ? std::cerr : std::cout);

    // The loss and the bytes this step sent across replicas, summed over the ranks of the sum.
    auto sums = torch::tensor(
        {loss.item<double>(), static_cast<double>(model.comm_stats().replica_bytes - replica_bytes_before)},
        torch::kDouble);
    fsdp::all_reduce(metrics_pg, sums);
    auto mem = torch::tensor({peak, state, state_peak, buffers, peak - state_peak - buffers}, torch::kLong);
    fsdp::all_reduce(metrics_pg, mem, c10d::ReduceOp::MAX);
    last_peak = peak;
    last_state = state;
    const double l = sums[0].item<double>() / metrics_world;  // the same on every rank (of the replica)
    // One replica's bytes (the sum is one replica's ranks, or every replica's), each replica sending
    // the same (its ranks hold the same shapes).
    const auto replica_comm_bytes = std::llround(sums[1].item<double>() / (args.outer.on() ? 1 : replicas));
    if (rank == 0) {
      const auto speed = fsdp::programs::step_throughput(flops_shape, T, args.batch_size * T, ms, peak_tflops, world);
      if (args.json) {
        fsdp::programs::JsonRow()
            .add("step", step)
            .add("loss", l, "%.9g")
            .add("flops_per_token", speed.flops_per_token, "%.17g")
            .add("tokens_per_s", speed.tokens_per_s, "%.6g")
            .add("mfu", speed.mfu, "%.6g")
            .add("peak_bytes", mem[0].item<int64_t>())
            .add("state_bytes", mem[1].item<int64_t>())
            .add("state_peak_bytes", mem[2].item<int64_t>())
            .add("buffer_bytes", mem[3].item<int64_t>())
            .add("other_bytes", mem[4].item<int64_t>())
            .add("step_ms", ms, "%.3f")
            .add("world_size", world)
            .add("params", n_params)
            .add("grad_norm", grad_norm, "%.9g")
            .add("epoch", share->epoch)
            .add("samples_consumed", sampler.state().samples_consumed)
            .add("committed_step", checkpoints.committed_step())
            .add("replica_comm_bytes", static_cast<int64_t>(replica_comm_bytes))
            .print();
      } else {
        std::printf(
            "step %4lld | epoch %lld | loss %.4f | grad norm %.4g | %8.1f ms | peak %s | state %s (max over ranks)\n",
            static_cast<long long>(step), static_cast<long long>(share->epoch), l, grad_norm, ms,
            mib(mem[0].item<int64_t>()).c_str(), mib(mem[1].item<int64_t>()).c_str());
      }
      std::fflush(stdout);
    }
    if (!std::isfinite(l)) {
      std::ostringstream msg;
      msg << "the loss of step " << step << " is "
          << (std::isnan(l) ? "NaN"
              : l < 0       ? "-inf"
                            : "inf")
          << ", not finite (the mean over the global batch, the "
          << "same on every rank): training diverged. Stopping; lower --lr (now " << args.lr
          << "), check --data, or clip with --clip MAX_NORM.";
      throw std::runtime_error(msg.str());
    }
    // fp16: the loss scale and its growth count go with the checkpoint (grad_scaler.*).
    fsdp::checkpoint::Metadata meta = scaler.state_dict();
    meta.insert(
        {{"seed", std::to_string(seed)}, {"global_batch", std::to_string(args.batch_size)}, {"example", "train_gpt"}});
    const std::string saved = checkpoints.after_step(step, model, *opt, sampler, meta);
    if (rank == 0 && !saved.empty()) std::cerr << who() << ": " << saved << "\n";
  }
  outer.flush();  // --overlap: the last outer exchange, still in flight
  checkpoints.finish();

  // Per-rank memory of the last step, gathered on rank 0.
  auto per_rank = torch::zeros({world, 2}, torch::kLong);
  per_rank[rank][0] = last_peak;
  per_rank[rank][1] = last_state;
  fsdp::all_reduce(pg, per_rank);
  const int64_t timed = args.steps - first_step - 1;  // steps after the first one run
  const double mean_ms = timed > 0 ? total_ms / static_cast<double>(timed) : 0.0;
  auto step_ms = torch::zeros({world}, torch::kDouble);
  step_ms[rank] = mean_ms;
  fsdp::all_reduce(pg, step_ms);
  if (rank == 0 && args.json) {
    std::vector<int64_t> peaks, states;
    std::vector<double> times;
    for (int r = 0; r < world; ++r) {
      peaks.push_back(per_rank[r][0].item<int64_t>());
      states.push_back(per_rank[r][1].item<int64_t>());
      times.push_back(step_ms[r].item<double>());
    }
    // The model state the strategy's formula gives (fsdp/strategy.h), for the scripts that check it.
    fsdp::FormulaInputs in{static_cast<double>(n_params), 0, 0, world,
                           fsdp::traits(strategy).shard_over == fsdp::ShardOver::kGroup ? group : world};
    std::string formula = fsdp::traits(strategy).formula_at_step;
    if (args.outer.diloco > 0) {
      in.outer_bytes = args.outer.outer_momentum > 0 ? fsdp::kDiLoCoOuterBytes : 4;
      formula += in.outer_bytes == fsdp::kDiLoCoOuterBytes ? " + 8Ψ/S" : " + 4Ψ/S";  // DiLoCo's outer state
    }
    fsdp::programs::JsonRow()
        .add("summary", true)
        .add("world_size", world)
        .add("params", n_params)
        .add("strategy", fsdp::to_string(strategy))
        .add("shard_group_size", group)
        .add("per_rank_peak_bytes", peaks)
        .add("per_rank_state_bytes", states)
        .add("per_rank_mean_step_ms", fsdp::programs::rounded(times, "%.6f"))
        .add("formula_state_bytes", fsdp::state_bytes_at_step(strategy, in), "%.1f")
        .add("formula_text", formula)
        .add("saves_started", checkpoints.started())
        .add("saves_skipped", checkpoints.skipped())
        .add("steps_lost_max", checkpoints.lost_max())
        .add("steps_lost_mean", checkpoints.lost_mean(), "%.3f")
        .add("save_held_s", checkpoints.held_seconds(), "%.4f")
        .print();
  } else if (rank == 0) {
    std::printf("per-rank memory (last step): %s allocator peak, model state at the optimizer step\n",
                device.is_cuda() ? "CUDA caching" : "counting CPU");
    for (int r = 0; r < world; ++r) {
      std::printf("  rank %d: peak %s, state %s\n", r, mib(per_rank[r][0].item<int64_t>()).c_str(),
                  mib(per_rank[r][1].item<int64_t>()).c_str());
    }
    if (timed > 0) {
      std::printf("mean step time (steps %lld..%lld): %.1f ms\n", static_cast<long long>(first_step + 1),
                  static_cast<long long>(args.steps - 1), mean_ms);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  g_t_main = wall_seconds();
  fsdp::memory::enable_cpu_counting();  // first: count every allocation from here on
  return g_program.main([&] {
    const Args args = parse(argc, argv);
    g_program.set_json_errors(args.json);
    return run(args);
  });
}
