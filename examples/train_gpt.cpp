// Trains a small GPT with fully sharded data parallelism.
//
//   build/examples/train_gpt --steps 20                                  # one process
//   torchrun --no-python --nproc-per-node 2 build/examples/train_gpt     # two ranks
//
// Every rank takes its share of each global batch, so the data seen (and the losses printed) do
// not depend on the number of ranks. --json prints one JSON object per step on rank 0, then one
// summary object with every rank's memory and mean step time.
#include "examples/gpt.h"
#include "examples/strategy_flags.h"
#include "fsdp/fsdp.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#ifndef FSDP_EXAMPLE_CORPUS
#define FSDP_EXAMPLE_CORPUS "examples/data/corpus.txt"
#endif

namespace {

struct Args {
  gpt::Config model;
  int64_t steps = 50;
  int64_t batch_size = 12;  // global
  uint64_t seed = 1;
  double lr = 1e-3;
  double weight_decay = 0.1;
  std::string optimizer = "adamw";
  std::string data = FSDP_EXAMPLE_CORPUS;
  bool json = false;
  int prefetch = 1;
  int64_t grad_accum = 1;         // micro-batches per step
  bool no_sync = false;           // communicate only in the last micro-batch
  double clip = 0;                // max global gradient norm (0: no clipping)
  bool fused = false;             // fsdp::optim::FusedAdamW instead of torch::optim::AdamW
  std::string strategy = "full";  // full (ZeRO-3) | grad-op (ZeRO-2) | optimizer (ZeRO-1) | replicate | hybrid
  int shard_group_size = 0;       // hybrid: ranks per sharding group (default: half the ranks, at least 1)
  double bucket_mb = 25;          // replicate: all-reduce bucket size
  bool build_sharded = false;     // shard each block as it is built (fsdp::ShardingScope)
};

[[noreturn]] void usage(const std::string& error) {
  std::cerr << "train_gpt: " << error << "\n"
            << "usage: train_gpt [--steps N] [--batch-size B] [--seed S] [--lr LR] [--weight-decay WD]\n"
            << "                 [--optimizer adamw|sgd] [--n-layer L] [--n-head H] [--n-embd C]\n"
            << "                 [--block-size T] [--data FILE] [--prefetch K] [--grad-accum M] [--no-sync]\n"
            << "                 [--clip MAX_NORM] [--fused] [--json]\n"
            << "                 [--strategy full|grad-op|optimizer|replicate|hybrid] [--shard-group-size S]\n"
            << "                 [--bucket-mb MB] [--build-sharded]\n"
            << "  --strategy: full sharding (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), optimizer state only (ZeRO-1),\n"
            << "  replicated (DDP), or hybrid: full sharding inside groups of S consecutive ranks (default N/2).\n"
            << "  --build-sharded: shard each block while the model is built (a model larger than one rank).\n"
            << "  --batch-size is the global batch: each of the N ranks takes B/N rows of it, in M micro-batches\n"
            << "  with --grad-accum M (--no-sync: reduce gradients only after the last one).\n";
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (k == "--json" || k == "--no-sync" || k == "--fused" || k == "--build-sharded") {
      (k == "--json" ? a.json : k == "--no-sync" ? a.no_sync : k == "--fused" ? a.fused : a.build_sharded) = true;
      continue;
    }
    if (k == "--help" || k == "-h") usage("help");
    if (i + 1 >= argc) usage("missing value after " + k);
    std::string v = argv[++i];
    try {
      if (k == "--steps")
        a.steps = std::stoll(v);
      else if (k == "--batch-size")
        a.batch_size = std::stoll(v);
      else if (k == "--seed")
        a.seed = std::stoull(v);
      else if (k == "--lr")
        a.lr = std::stod(v);
      else if (k == "--weight-decay")
        a.weight_decay = std::stod(v);
      else if (k == "--optimizer")
        a.optimizer = v;
      else if (k == "--n-layer")
        a.model.n_layer = std::stoll(v);
      else if (k == "--n-head")
        a.model.n_head = std::stoll(v);
      else if (k == "--n-embd")
        a.model.n_embd = std::stoll(v);
      else if (k == "--block-size")
        a.model.block_size = std::stoll(v);
      else if (k == "--data")
        a.data = v;
      else if (k == "--prefetch")
        a.prefetch = std::stoi(v);
      else if (k == "--grad-accum")
        a.grad_accum = std::stoll(v);
      else if (k == "--clip")
        a.clip = std::stod(v);
      else if (k == "--strategy")
        a.strategy = v;
      else if (k == "--shard-group-size")
        a.shard_group_size = std::stoi(v);
      else if (k == "--bucket-mb")
        a.bucket_mb = std::stod(v);
      else
        usage("unknown flag " + k);
    } catch (const std::logic_error&) {
      usage("bad value '" + v + "' for " + k);
    }
  }
  if (a.optimizer != "adamw" && a.optimizer != "sgd") usage("--optimizer must be adamw or sgd");
  if (a.model.n_embd % a.model.n_head != 0) usage("--n-embd must be a multiple of --n-head");
  if (a.steps < 1 || a.batch_size < 1) usage("--steps and --batch-size must be positive");
  if (a.prefetch < 0) usage("--prefetch must be 0 (off) or more");
  if (a.grad_accum < 1) usage("--grad-accum must be at least 1");
  if (gpt::strategy_flags().count(a.strategy) == 0)
    usage("--strategy must be full, grad-op, optimizer, replicate or hybrid");
  if (a.shard_group_size < 0) usage("--shard-group-size must be positive");
  if (a.bucket_mb <= 0) usage("--bucket-mb must be positive");
  if (a.fused && a.optimizer != "adamw") usage("--fused is an AdamW");
  return a;
}

torch::Tensor load_corpus(const std::string& path, int64_t block_size) {
  std::ifstream f(path, std::ios::binary);
  TORCH_CHECK(f, "train_gpt: cannot read the corpus '", path, "' (pass --data FILE)");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  TORCH_CHECK(static_cast<int64_t>(text.size()) > block_size + 1, "train_gpt: the corpus '", path, "' has ",
              text.size(), " bytes; it needs more than --block-size + 1 = ", block_size + 1);
  auto bytes = torch::from_blob(text.data(), {static_cast<int64_t>(text.size())}, torch::kUInt8);
  return bytes.to(torch::kLong);  // byte-level tokens, vocabulary 256
}

std::string mib(int64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(b) / (1024.0 * 1024.0));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::memory::enable_cpu_counting();  // first: count every allocation from here on
  const Args args = parse(argc, argv);
  auto pg = fsdp::init_process_group();
  const int rank = pg->getRank(), world = pg->getSize();
  const int64_t K = args.grad_accum;
  TORCH_CHECK(args.batch_size % (world * K) == 0, "train_gpt (rank ", rank, "): --batch-size ", args.batch_size,
              " is not divisible by the ", world, " ranks x ", K,
              " micro-batches; each rank takes an equal share of every micro-batch.");
  const int64_t micro = args.batch_size / K;  // rows per micro-batch (all ranks)
  const int64_t local_batch = micro / world;  // rows per micro-batch on this rank
  const int64_t T = args.model.block_size;
  auto data = load_corpus(args.data, T);

  const fsdp::ShardingStrategy strategy = gpt::strategy_flags().at(args.strategy);
  const int group = args.shard_group_size > 0 ? args.shard_group_size : std::max(1, world / 2);
  const auto options = fsdp::FullyShardOptions()
                           .prefetch(args.prefetch)
                           .strategy(strategy)
                           .shard_group_size(group)
                           .bucket_bytes(static_cast<int64_t>(args.bucket_mb * 1024 * 1024));
  torch::manual_seed(args.seed);
  // With --build-sharded each block is sharded as soon as it is constructed, so the whole model
  // never exists on one rank; the weights are the same either way (same seed, same draws).
  auto model = args.build_sharded ? [&] {
    fsdp::ShardingScope scope(pg, options);
    return fsdp::fully_shard(gpt::make_gpt<true>(args.model), scope);
  }()
                                  : fsdp::fully_shard(gpt::make_gpt<true>(args.model), pg, options);
  const int64_t n_params = model.num_parameters();  // Ψ: elements of the full model

  std::unique_ptr<torch::optim::Optimizer> opt;
  if (args.fused) {
    opt = std::make_unique<fsdp::optim::FusedAdamW>(
        model, torch::optim::AdamWOptions(args.lr).weight_decay(args.weight_decay));
  } else if (args.optimizer == "adamw") {
    opt = std::make_unique<torch::optim::AdamW>(model.sharded_parameters(),
                                                torch::optim::AdamWOptions(args.lr).weight_decay(args.weight_decay));
  } else {
    opt = std::make_unique<torch::optim::SGD>(
        model.sharded_parameters(), torch::optim::SGDOptions(args.lr).momentum(0.9).weight_decay(args.weight_decay));
  }

  if (rank == 0 && !args.json) {
    std::cout << "train_gpt: " << world << " rank(s), " << n_params << " parameters, " << args.model.n_layer
              << " sharded blocks, global batch " << args.batch_size << " x " << T << " tokens (" << local_batch
              << " rows per rank per micro-batch, " << K << " micro-batch(es)" << (args.no_sync ? ", no sync" : "")
              << "), " << (args.fused ? "fused " : "") << args.optimizer << " lr " << args.lr
              << (args.clip > 0 ? ", clip " + std::to_string(args.clip) : "") << ", prefetch " << args.prefetch
              << ", strategy " << fsdp::to_string(strategy)
              << (strategy == fsdp::ShardingStrategy::kHybridShard ? " (groups of " + std::to_string(group) + ")" : "")
              << "\n";
  }

  int64_t last_peak = 0, last_state = 0;
  double total_ms = 0;
  for (int64_t step = 0; step < args.steps; ++step) {
    opt->zero_grad();
    fsdp::memory::reset_peak();
    const auto t0 = std::chrono::steady_clock::now();

    // The global batch of this step, the same on every rank; this rank takes its rows.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(args.seed * 1000003 + static_cast<uint64_t>(step));
    auto offsets = torch::randint(data.size(0) - T - 1, {args.batch_size}, gen, torch::kLong);
    auto loss = torch::zeros({}, torch::kDouble);  // this rank's mean over its rows of the step
    for (int64_t m = 0; m < K; ++m) {
      auto mine = offsets.narrow(0, m * micro + rank * local_batch, local_batch);
      auto idx = torch::arange(T, torch::kLong).unsqueeze(0) + mine.unsqueeze(1);
      auto x = data.index({idx}), y = data.index({idx + 1});
      model.set_requires_gradient_sync(!args.no_sync || m == K - 1);
      auto logits = model(x);
      auto l = torch::nn::functional::cross_entropy(logits.flatten(0, 1), y.flatten()) / static_cast<double>(K);
      l.backward();
      loss += l.detach().to(torch::kDouble);
    }
    double grad_norm = -1;
    if (args.clip > 0) grad_norm = fsdp::optim::clip_grad_norm(model, args.clip);
    opt->step();

    // Model state at the optimizer step: sharded parameters, gradients, optimizer state.
    const int64_t state = fsdp::optim::state_bytes(model.sharded_parameters(), opt.get()).total();
    const int64_t peak = fsdp::memory::stats().peak_bytes;
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (step > 0) total_ms += ms;

    auto global_loss = loss.detach().to(torch::kDouble).reshape({1});
    fsdp::all_reduce(pg, global_loss);
    auto mem = torch::tensor({peak, state}, torch::kLong);
    fsdp::all_reduce(pg, mem, c10d::ReduceOp::MAX);
    last_peak = peak;
    last_state = state;
    if (rank == 0) {
      const double l = global_loss.item<double>() / world;
      if (args.json) {
        std::printf(
            "{\"step\": %lld, \"loss\": %.9g, \"peak_bytes\": %lld, \"state_bytes\": %lld, "
            "\"step_ms\": %.3f, \"world_size\": %d, \"params\": %lld, \"grad_norm\": %.9g}\n",
            static_cast<long long>(step), l, static_cast<long long>(mem[0].item<int64_t>()),
            static_cast<long long>(mem[1].item<int64_t>()), ms, world, static_cast<long long>(n_params), grad_norm);
      } else {
        std::printf("step %4lld | loss %.4f | %8.1f ms | peak %s | state %s (max over ranks)\n",
                    static_cast<long long>(step), l, ms, mib(mem[0].item<int64_t>()).c_str(),
                    mib(mem[1].item<int64_t>()).c_str());
      }
      std::fflush(stdout);
    }
  }

  // Per-rank memory of the last step, gathered on rank 0.
  auto per_rank = torch::zeros({world, 2}, torch::kLong);
  per_rank[rank][0] = last_peak;
  per_rank[rank][1] = last_state;
  fsdp::all_reduce(pg, per_rank);
  const double mean_ms = args.steps > 1 ? total_ms / static_cast<double>(args.steps - 1) : 0.0;
  auto step_ms = torch::zeros({world}, torch::kDouble);
  step_ms[rank] = mean_ms;
  fsdp::all_reduce(pg, step_ms);
  if (rank == 0 && args.json) {
    std::string peaks, states, times;
    for (int r = 0; r < world; ++r) {
      const char* sep = r ? ", " : "";
      peaks += sep + std::to_string(per_rank[r][0].item<int64_t>());
      states += sep + std::to_string(per_rank[r][1].item<int64_t>());
      times += sep + std::to_string(step_ms[r].item<double>());
    }
    std::printf(
        "{\"summary\": true, \"world_size\": %d, \"params\": %lld, \"strategy\": \"%s\", \"shard_group_size\": %d, "
        "\"per_rank_peak_bytes\": [%s], \"per_rank_state_bytes\": [%s], \"per_rank_mean_step_ms\": [%s]}\n",
        world, static_cast<long long>(n_params), fsdp::to_string(strategy), group, peaks.c_str(), states.c_str(),
        times.c_str());
  } else if (rank == 0) {
    std::printf("per-rank memory (last step): counting CPU allocator peak, model state at the optimizer step\n");
    for (int r = 0; r < world; ++r) {
      std::printf("  rank %d: peak %s, state %s\n", r, mib(per_rank[r][0].item<int64_t>()).c_str(),
                  mib(per_rank[r][1].item<int64_t>()).c_str());
    }
    if (args.steps > 1) {
      std::printf("mean step time (steps 1..%lld): %.1f ms\n", static_cast<long long>(args.steps - 1), mean_ms);
    }
  }
  return 0;
}
