// fsdp::checkpoint::load: checkpoints saved at 1-4 ranks, with every strategy and a mix, each with
// an optimizer, loaded at 1-4 ranks with the same strategy and with another one, and into a plain
// module: every tensor bit for bit, each rank reading the bytes of its own rows (with their
// checksum blocks), the loaded model computing what a plain LibTorch model with the same weights
// computes, and training going on as without the interruption. Then the generators' states.
#include "tests/checkpoint_helpers.h"

#include "checkpoint/async_save.h"

#include <c10/util/accumulate.h>
#include <torch/cuda.h>

#include <iostream>

namespace fsdp::testing {
namespace {

// Every tensor of two checkpoints (each rank's generators apart: as many as ranks saved) equal.
void expect_same_checkpoints(const std::string& a_dir, const std::string& b_dir) {
  auto a = read_all(a_dir), b = read_all(b_dir);
  for (auto* all : {&a, &b}) {
    for (auto it = all->begin(); it != all->end();) it = it->first.rfind("rng/", 0) == 0 ? all->erase(it) : ++it;
  }
  ASSERT_EQ(a.size(), b.size()) << a_dir << " and " << b_dir;
  for (const auto& [key, t] : a) {
    ASSERT_EQ(b.count(key), 1u) << b_dir << " lacks " << key;
    EXPECT_TRUE(t.equal(b.at(key))) << a_dir << " and " << b_dir << ": " << key;
  }
}

// At N ranks: each case trained one step with its optimizer (so that no weight or moment is its
// initial value), saved, its full weights written beside it by rank 0 as the reference, and then
// trained two more steps, whose losses are the reference for a load that continues training.
void save_all(Rank& r) {
  const std::string root = root_dir();
  const auto cases = saved_cases(r.world_size);
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const std::string name = ckpt_name(r.world_size, c);
    auto model = wrap(c, r, 7);
    auto opt = make_opt(opt_of(r.world_size, i), model);
    train_step(model, *opt, r, 0);
    const auto full = model.full_state_dict(/*rank0_only=*/true);
    const auto res = checkpoint::save(root, model, *opt, checkpoint::SaveOptions().name(name).step(1));
    if (r.rank == 0) {
      // Each unique byte once: the chunks add up to the model's and the moments' bytes, from shapes.
      const int64_t moments = opt_of(r.world_size, i) == Opt::kSGD ? 1 : 2;
      int64_t unique = 0;
      for (const auto& s : model.shard_specs()) {
        unique +=
            (1 + moments) * c10::multiply_integers(s.global_shape) * static_cast<int64_t>(c10::elementSize(s.dtype));
      }
      for (const auto& b : model.buffers()) unique += b.numel() * b.element_size();
      // Apart: each rank's CPU generator state (no CUDA here).
      EXPECT_EQ(res.bytes_total, unique + r.world_size * rng_bytes()) << name;
      const auto m = checkpoint::read_manifest(res.path);
      EXPECT_EQ(m.optimizer.steps.size(), moments == 2 ? model.shard_specs().size() : 0u) << name;
      for (const auto& kv : m.optimizer.steps) EXPECT_EQ(kv.second, 1) << name << ": " << kv.first;
    }
    const double l1 = train_step(model, *opt, r, 1), l2 = train_step(model, *opt, r, 2);
    if (r.rank == 0) {
      torch::serialize::OutputArchive out;
      for (const auto& kv : full) out.write(kv.key(), kv.value());
      out.write("loss1", torch::tensor(l1, torch::kDouble));
      out.write("loss2", torch::tensor(l2, torch::kDouble));
      out.save_to(root + "/" + name + ".ref");
    }
  }
}

// At M ranks: every checkpoint of every N, with its own strategy and with another (rotating), and
// AdamW's state into FusedAdamW and back on the second load.
void load_all(Rank& r) {
  const std::string root = root_dir();
  const int M = r.world_size;
  const auto load_cases = saved_cases(M);
  int64_t needed = 0, read = 0;
  for (int N = 1; N <= 4; ++N) {
    const auto saved = saved_cases(N);
    for (size_t i = 0; i < saved.size(); ++i) {
      const std::string name = ckpt_name(N, saved[i]);
      auto want = read_reference(root + "/" + name + ".ref");
      const double loss1 = want["loss1"].item<double>(), loss2 = want["loss2"].item<double>();
      want.erase("loss1");
      want.erase("loss2");
      for (int second = 0; second < 2; ++second) {
        const Case& c = load_cases[second ? (i + 1 + N) % load_cases.size() : i];
        Opt o = opt_of(N, i);
        if (second && o != Opt::kSGD) o = o == Opt::kAdamW ? Opt::kFused : Opt::kAdamW;
        const std::string what =
            name + " loaded at " + std::to_string(M) + " ranks as " + c.label + " with " + opt_label(o);
        SCOPED_TRACE(what);
        auto model = wrap(c, r, 1234);  // other weights before the load
        auto opt = make_opt(o, model);
        // The second load reads in place (LoadOptions::in_place): the same values, whatever N and M.
        const auto res = checkpoint::load(root + "/" + name, model, *opt, checkpoint::LoadOptions().in_place(second));
        EXPECT_EQ(res.saved_world_size, N);
        EXPECT_EQ(res.step, 1);
        // Needed: the rows this rank holds of each parameter and of each of its moments, from shapes.
        int64_t mine = 0;
        const int64_t moments = o == Opt::kSGD ? 1 : 2;
        for (const auto& s : model.shard_specs()) mine += (1 + moments) * s.local.numel() * s.local.element_size();
        for (const auto& b : model.buffers()) mine += b.numel() * b.element_size();
        if (r.rank < N) mine += rng_bytes();  // its own generator's state
        EXPECT_EQ(res.bytes_needed, mine);
        EXPECT_EQ(res.rng, r.rank < N ? "restored" : "derived");
        EXPECT_GE(res.bytes_read, res.bytes_needed);
        EXPECT_LE(res.files_opened, N);
        needed += res.bytes_needed;
        read += res.bytes_read;
        expect_bit_exact(model.full_state_dict(), want, what);
        if (::testing::Test::HasFailure()) return;

        if (!second) {
          // Saved again at M right away: every tensor (the moments too) and the optimizer's record
          // equal the original's bit for bit.
          const std::string again = name + "-at" + std::to_string(M);
          checkpoint::save(root, model, *opt, checkpoint::SaveOptions().name(again).step(1));
          if (r.rank == 0) {
            expect_same_checkpoints(root + "/" + name, root + "/" + again);
            const auto ma = checkpoint::read_manifest(root + "/" + name),
                       mb = checkpoint::read_manifest(root + "/" + again);
            EXPECT_EQ(ma.optimizer.steps, mb.optimizer.steps);
            ASSERT_EQ(ma.optimizer.param_groups.size(), mb.optimizer.param_groups.size());
            EXPECT_EQ(ma.optimizer.param_groups[0].options, mb.optimizer.param_groups[0].options);
            EXPECT_EQ(ma.optimizer.param_groups[0].params, mb.optimizer.param_groups[0].params);
          }
        }

        // It computes what a plain model loaded from the same checkpoint computes (ZeRO-1's full
        // parameters were gathered again from the loaded rows) ...
        torch::manual_seed(4321);
        auto plain = std::make_shared<PlainMLPImpl>();
        checkpoint::load(root + "/" + name, *plain);
        expect_bit_exact(state_of(*plain), want, what + ", plain");
        torch::manual_seed(11);
        auto x = torch::randn({kGlobalBatch, 7});
        auto loss = model(local_rows(x, r.rank, M)).square().mean().detach() / M;
        all_reduce_sum(r, loss);
        EXPECT_NEAR(loss.item<double>(), plain->forward(x).square().mean().item<double>(), 1e-6);
        // ... and training goes on as it did at N ranks without the interruption.
        const double l1 = train_step(model, *opt, r, 1), l2 = train_step(model, *opt, r, 2);
        EXPECT_NEAR(l1, loss1, 1e-5 * std::abs(loss1)) << what;
        EXPECT_NEAR(l2, loss2, 1e-5 * std::abs(loss2)) << what;
      }
    }
  }
  if (r.rank == 0) std::cout << "loads at " << M << " ranks: read/needed " << double(read) / needed << std::endl;
}

TEST(CheckpointLoad, ReshardMatrixEveryStrategyBitExact) {
  CheckpointRoot root;
  root.options.timeout = std::chrono::seconds(300);
  for (int N = 1; N <= 4; ++N) run_ranks(N, save_all, root.options);
  for (int M = 1; M <= 4; ++M) run_ranks(M, load_all, root.options);
}

// On the GPU, in the testing mode of several ranks on one GPU (FSDP_TEST_GLOO_CUDA=1; skipped
// without a GPU): a sharded GPU model (moved there by FullyShardOptions::device) saved at 2 ranks,
// synchronously and in the background (the same tensors), loads bit for bit at 1 rank on the GPU
// and at 3 ranks on the CPU, and saved again there equals the original, optimizer state included.
FullyShardedModule<BufferedMLPImpl> wrap_on(Rank& r, uint64_t seed, const torch::Device& device) {
  const Case full = saved_cases(r.world_size).front();  // full sharding
  return fsdp::fully_shard(build(full, r, seed), r.pg, test_options(full.strategy, full.group).device(device));
}

torch::Device gpu_or_cpu() {
  const char* mode = std::getenv("FSDP_TEST_GLOO_CUDA");
  return mode != nullptr && std::string(mode) == "1" ? fsdp::cuda_device() : torch::Device(torch::kCPU);
}

torch::OrderedDict<std::string, at::Tensor> on_cpu(const torch::OrderedDict<std::string, at::Tensor>& dict) {
  torch::OrderedDict<std::string, at::Tensor> out;
  for (const auto& kv : dict) out.insert(kv.key(), kv.value().cpu());
  return out;
}

void save_on_gpu(Rank& r) {
  const torch::Device dev = gpu_or_cpu();
  ASSERT_TRUE(dev.is_cuda());
  auto model = wrap_on(r, 7, dev);
  auto opt = make_opt(Opt::kAdamW, model);
  torch::manual_seed(100);
  const auto x = torch::randn({kGlobalBatch, 7}).to(dev);
  model(local_rows(x, r.rank, r.world_size)).square().mean().backward();
  opt->step();
  const auto full = on_cpu(model.full_state_dict(/*rank0_only=*/true));
  checkpoint::save(root_dir(), model, *opt, checkpoint::SaveOptions().name("gpu-sync").step(1));
  checkpoint::AsyncSaver saver(model);
  saver.save(root_dir(), *opt, checkpoint::SaveOptions().name("gpu-async").step(1));
  saver.wait();
  if (r.rank != 0) return;
  torch::serialize::OutputArchive out;
  for (const auto& kv : full) out.write(kv.key(), kv.value());
  out.save_to(root_dir() + "/gpu.ref");
  expect_same_checkpoints(root_dir() + "/gpu-sync", root_dir() + "/gpu-async");
}

void load_elsewhere(Rank& r) {
  const torch::Device dev = gpu_or_cpu();
  const auto want = read_reference(root_dir() + "/gpu.ref");
  for (const char* name : {"gpu-sync", "gpu-async"}) {
    const std::string what =
        std::string(name) + " loaded at " + std::to_string(r.world_size) + " ranks on " + dev.str();
    auto model = wrap_on(r, 1234, dev);  // other weights before the load
    auto opt = make_opt(Opt::kAdamW, model);
    const auto res = checkpoint::load(root_dir() + "/" + name, model, *opt);
    EXPECT_EQ(res.saved_world_size, 2) << what;
    for (const auto& p : model.parameters()) EXPECT_EQ(p.device(), dev) << what;
    expect_bit_exact(on_cpu(model.full_state_dict()), want, what);
    const std::string again = std::string(name) + "-at" + std::to_string(r.world_size);
    checkpoint::save(root_dir(), model, *opt, checkpoint::SaveOptions().name(again).step(1));
    if (r.rank == 0) expect_same_checkpoints(root_dir() + "/" + name, root_dir() + "/" + again);
  }
}

TEST(GlooCuda, ASaveAtTwoRanksOnTheGpuLoadsBitExactAtOneOnTheGpuAndAtThreeOnTheCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  CheckpointRoot root;
  root.options.timeout = std::chrono::seconds(240);
  RunOptions on_gpu = root.options;
  on_gpu.env["FSDP_TEST_GLOO_CUDA"] = "1";
  run_ranks(2, save_on_gpu, on_gpu);
  run_ranks(1, load_elsewhere, on_gpu);
  run_ranks(3, load_elsewhere, root.options);
}

// Generator states: saved at 2 ranks, loaded at 3. Ranks 0 and 1 draw what they drew after the
// save; rank 2, new, derives its own: the same on every such load, unlike the others'.
std::vector<float> draw() {
  const auto t = torch::rand({4});
  return {t.data_ptr<float>(), t.data_ptr<float>() + 4};
}
void save_rng(Rank& r) {
  const Case full{"full", ShardingStrategy::kFullShard, 0, false};
  auto model = wrap(full, r, 7);
  torch::manual_seed(50 + r.rank);
  draw();
  checkpoint::save(root_dir(), model, checkpoint::SaveOptions().name("rng"));
  torch::save(torch::tensor(draw()), root_dir() + "/draw-" + std::to_string(r.rank) + ".pt");
}
void load_rng(Rank& r) {
  const Case full{"full", ShardingStrategy::kFullShard, 0, false};
  auto model = wrap(full, r, 1234);
  std::vector<std::vector<float>> draws;
  for (uint64_t seed : {999, 12345}) {
    torch::manual_seed(seed + r.rank);
    const auto res = checkpoint::load(root_dir() + "/rng", model);
    EXPECT_EQ(res.rng, r.rank < 2 ? "restored" : "derived");
    draws.push_back(draw());
  }
  EXPECT_EQ(draws[0], draws[1]) << "the same load draws the same numbers";
  if (r.rank < 2) {
    at::Tensor saved;
    torch::load(saved, root_dir() + "/draw-" + std::to_string(r.rank) + ".pt");
    EXPECT_EQ(draws[0], std::vector<float>(saved.data_ptr<float>(), saved.data_ptr<float>() + 4));
  }
  // Every rank's draws differ from every other's.
  auto mine = torch::tensor(draws[0]);
  auto gathered = torch::zeros({3, 4});
  gathered[r.rank] = mine;
  all_reduce_sum(r, gathered);
  for (int a = 0; a < 3; ++a) {
    for (int b = a + 1; b < 3; ++b) EXPECT_FALSE(gathered[a].equal(gathered[b])) << a << " and " << b;
  }
  // Not restored when not asked for, nor from a checkpoint saved without them.
  torch::manual_seed(77);
  const auto before = draw();
  torch::manual_seed(77);
  EXPECT_EQ(checkpoint::load(root_dir() + "/rng", model, checkpoint::LoadOptions().rng_states(false)).rng,
            "not loaded");
  EXPECT_EQ(draw(), before);
}

TEST(CheckpointLoad, GeneratorStatesRestoredAndDerivedForNewRanks) {
  CheckpointRoot root;
  run_ranks(2, save_rng, root.options);
  run_ranks(3, load_rng, root.options);
}
}  // namespace
}  // namespace fsdp::testing
