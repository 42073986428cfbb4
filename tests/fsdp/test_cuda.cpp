// The CUDA path at world size 1 (NCCL), for scripts/gpu-check.sh on a machine with a GPU; skipped
// where there is none (every CI machine). Parity against plain LibTorch on the same device in fp32
// and bf16, model state from the caching allocator against the shapes, CPU offload, and the asynchronous save
// of a model in GPU memory against a synchronous one; the collectives on side streams (launched
// over the one-rank NCCL group, which the model itself would skip), with the one-rank launch they
// rely on checked on CPU (Gloo) everywhere.
#include "checkpoint/async_save.h"
#include "checkpoint/checkpoint.h"
#include "fsdp/internal/comm.h"
#include "optim/fused_adamw.h"
#include "tests/mixed_reference.h"

#include <torch/cuda.h>

#include <fstream>
#include <functional>
#include <iterator>
#include <tuple>

namespace fsdp::testing {
namespace {

const gpt::Config kCfg{37, 8, 2, 2, 18, false};

bool have_cuda() {
  return torch::cuda::is_available();
}

// One rank whose group has NCCL for CUDA tensors (the harness's default is Gloo alone).
void run_on_gpu(const std::function<void(Rank&)>& body) {
  RunOptions options;
  options.nccl = true;
  run_ranks(1, body, options);
}

// cuBLAS keeps a workspace per handle and stream (64 MiB on an H200), taken from the caching
// allocator at a thread's first matmul and kept, as in any LibTorch program; backward's matmuls
// run on autograd's device thread, whose handle is its own. A throwaway step of the plain model
// takes both before a measurement starts, so that the bytes measured are the model's.
void warm_up(const torch::Device& dev) {
  auto m = gpt::make_gpt<false>(kCfg);
  m->to(dev);
  auto [x, y] = gpt_batch(kCfg, 1);
  gpt_loss(m->forward(x.to(dev)), y.to(dev)).backward();
  torch::cuda::synchronize();
}

std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// fp32: the wrapped model equals plain LibTorch on the GPU (1e-5, kernels may reorder sums); bf16
// (fp32 master weights) equals plain LibTorch doing the same casts by hand. The caching
// allocator's bytes after the step are the model state from shapes (parameters, gradients, AdamW
// moments: 16 bytes per parameter) and little else.
TEST(Cuda, ParityAndMemoryAtWorldSizeOne) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  run_on_gpu([&](Rank& r) {
    const torch::Device dev(torch::kCUDA, 0);
    EXPECT_EQ(fsdp::cuda_device(), dev);  // the GPU the process group bound (NCCL, local rank 0)
    for (bool bf16 : {false, true}) {
      warm_up(dev);
      torch::manual_seed(0);
      auto master = gpt::make_gpt<false>(kCfg);
      master->to(dev);
      auto compute = gpt::make_gpt<false>(kCfg);
      compute->to(dev, bf16 ? torch::kBFloat16 : torch::kFloat);
      torch::manual_seed(0);
      auto unwrapped = gpt::make_gpt<true>(kCfg);
      unwrapped->to(dev);
      const auto before = fsdp::memory::stats(dev).current_bytes;
      auto options = test_options();
      if (bf16) options.mixed_precision(MixedPrecisionPolicy().param_dtype(torch::kBFloat16));
      auto model = fsdp::fully_shard(unwrapped, r.pg, options);
      torch::optim::AdamW ref_opt(master->parameters(), torch::optim::AdamWOptions(1e-2));
      torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 4; ++step) {
        torch::Tensor x, y;
        std::tie(x, y) = gpt_batch(kCfg, 5000 + step);
        x = x.to(dev), y = y.to(dev);
        cast_into(*compute, *master);
        const auto ref_loss = reference_grads(*master, *compute, 1, at::kFloat, [&](int) {
                                return gpt_loss(compute->forward(x), y);
                              }).front();
        ref_opt.step();
        opt.zero_grad();
        auto loss = gpt_loss(model(x), y);
        loss.backward();
        opt.step();
        EXPECT_TRUE(
            close(loss.detach().cpu().to(torch::kFloat), ref_loss.detach().cpu().to(torch::kFloat), bf16 ? 1e-2 : 1e-5))
            << (bf16 ? "bf16" : "fp32") << " loss at step " << step;
      }
      auto want = master->named_parameters();
      for (const auto& kv : model.named_parameters()) {
        EXPECT_EQ(kv.value().device(), dev);
        EXPECT_TRUE(close(kv.value().detach().cpu(), want[kv.key()].detach().cpu(), bf16 ? 5e-2 : 1e-5)) << kv.key();
      }
      opt.zero_grad();
      const auto state = fsdp::optim::state_bytes(model.parameters(), &opt).total();
      const auto held = fsdp::memory::stats(dev).current_bytes - before;
      std::cout << "[cuda] " << (bf16 ? "bf16" : "fp32") << ": allocator bytes held after the step " << held
                << ", parameters + AdamW state from shapes " << state << '\n';
      EXPECT_GE(held, state);
      EXPECT_LE(held, state + state / 20 + (1 << 20)) << "nothing but the model state stays on the device";
    }
  });
}

// CPU offload on the GPU: the offloaded model trains as the same model without offload (fp32 and
// bf16; the optimizer steps on the CPU there, so within 1e-5 / 1e-2 rather than to the bit),
// between steps its parameters and gradients are pinned host tensors, and the caching allocator
// holds nothing of the model state after the step.
TEST(Cuda, OffloadTrainsAsWithoutOffloadAndFreesTheDevice) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  run_on_gpu([&](Rank& r) {
    const torch::Device dev(torch::kCUDA, 0);
    for (bool bf16 : {false, true}) {
      auto options = test_options();
      if (bf16) options.mixed_precision(MixedPrecisionPolicy().param_dtype(torch::kBFloat16));
      std::vector<torch::Tensor> off_losses;
      torch::OrderedDict<std::string, torch::Tensor> off_params;
      {  // The offloaded model first, alone on the device, so the allocator's bytes are its own.
        warm_up(dev);
        const auto before = fsdp::memory::stats(dev).current_bytes;
        torch::manual_seed(0);
        auto b = gpt::make_gpt<true>(kCfg);
        b->to(dev);
        auto off = fsdp::fully_shard(
            b, r.pg, test_options().mixed_precision(options.mixed_precision()).offload_policy(CPUOffloadPolicy()));
        torch::optim::AdamW opt(off.parameters(), torch::optim::AdamWOptions(1e-2));
        for (int step = 0; step < 4; ++step) {
          torch::Tensor x, y;
          std::tie(x, y) = gpt_batch(kCfg, 5000 + step);
          opt.zero_grad();
          auto loss = gpt_loss(off(x.to(dev)), y.to(dev));
          EXPECT_EQ(loss.device(), dev);
          loss.backward();
          for (const auto& p : off.parameters()) {
            EXPECT_TRUE(p.is_cpu() && p.is_pinned() && p.grad().is_cpu() && p.grad().is_pinned());
          }
          opt.step();
          off_losses.push_back(loss.detach().cpu().to(torch::kFloat));
        }
        opt.zero_grad();
        const auto held = fsdp::memory::stats(dev).current_bytes - before;
        std::cout << "[cuda] offload " << (bf16 ? "bf16" : "fp32") << ": allocator bytes held after the step " << held
                  << '\n';
        EXPECT_LE(held, 1 << 20) << "no model state on the device between steps (the buffer pool's few KiB aside)";
        for (const auto& kv : off.named_parameters()) off_params.insert(kv.key(), kv.value().detach().clone());
      }
      torch::manual_seed(0);
      auto a = gpt::make_gpt<true>(kCfg);
      a->to(dev);
      auto plain = fsdp::fully_shard(a, r.pg, options);
      torch::optim::AdamW opt(plain.parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 4; ++step) {
        torch::Tensor x, y;
        std::tie(x, y) = gpt_batch(kCfg, 5000 + step);
        opt.zero_grad();
        auto loss = gpt_loss(plain(x.to(dev)), y.to(dev));
        loss.backward();
        opt.step();
        EXPECT_TRUE(close(off_losses[step], loss.detach().cpu().to(torch::kFloat), bf16 ? 1e-2 : 1e-5))
            << (bf16 ? "bf16" : "fp32") << " loss at step " << step;
      }
      for (const auto& kv : plain.named_parameters()) {
        EXPECT_TRUE(close(off_params[kv.key()], kv.value().detach().cpu(), bf16 ? 5e-2 : 1e-5)) << kv.key();
      }
    }
    // The parameters move between host shards and device views with set_data, which resets their
    // AccumulateGrad: the unit's own (with its hook) must be back, so that a unit is reduced inside
    // backward (before the input's gradient), not at its end, at every step.
    torch::manual_seed(0);
    auto mlp = std::make_shared<UnevenMLPImpl<true>>();
    mlp->to(dev);
    auto model = fsdp::fully_shard(mlp, r.pg, test_options().offload_policy(CPUOffloadPolicy()));
    fsdp::optim::FusedAdamW opt(model);
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      model.reset_comm_stats();
      auto input = torch::randn({kGlobalBatch, 7}, dev).requires_grad_(true);
      int64_t reduced_before_input_grad = -1;
      input.register_hook(
          [&](const torch::Tensor&) { reduced_before_input_grad = model.comm_stats().reduce_scatters; });
      model(input).square().mean().backward();
      EXPECT_GE(reduced_before_input_grad, 2) << "the root and fc2 reduced inside backward at step " << step;
      opt.step();
    }
  });
}

// The asynchronous save of a model in GPU memory (a pinned snapshot): the same files as a
// synchronous save, and the stall (what save() costs the caller) reported.
TEST(Cuda, AsyncSaveFromDeviceMemory) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  run_on_gpu([&](Rank& r) {
    const torch::Device dev(torch::kCUDA, 0);
    torch::manual_seed(0);
    auto unwrapped = gpt::make_gpt<true>(gpt::Config{256, 64, 4, 4, 256, true});
    unwrapped->to(dev);
    auto model = fsdp::fully_shard(unwrapped, r.pg, test_options());
    torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-3));
    auto [x, y] = gpt_batch(gpt::Config{256, 64, 4, 4, 256, true}, 1);
    gpt_loss(model(x.to(dev)), y.to(dev)).backward();
    opt.step();
    const std::string root = shared_dir();
    const auto sync = checkpoint::save(root + "/sync", model, opt, checkpoint::SaveOptions().step(1));
    checkpoint::AsyncSaver saver(model);
    const auto started = saver.save(root + "/async", opt, checkpoint::SaveOptions().step(1));
    const auto done = saver.wait();
    std::cout << "[cuda] async save: stall " << started.seconds << " s for " << started.snapshot_bytes
              << " snapshot bytes; write " << done.seconds << " s\n";
    EXPECT_EQ(file_bytes(done.path + "/rank-00000.safetensors"), file_bytes(sync.path + "/rank-00000.safetensors"));
    // Loaded back into a model on the GPU (another initialisation), read into host memory and
    // copied, or in place (which reads straight into host shards only): the saved values.
    for (bool in_place : {false, true}) {
      torch::manual_seed(1);
      auto other = gpt::make_gpt<true>(gpt::Config{256, 64, 4, 4, 256, true});
      other->to(dev);
      auto loaded = fsdp::fully_shard(other, r.pg, test_options());
      torch::optim::AdamW loaded_opt(loaded.parameters(), torch::optim::AdamWOptions(1e-3));
      checkpoint::load(sync.path, loaded, loaded_opt, checkpoint::LoadOptions().in_place(in_place));
      auto want = model.named_parameters();
      for (const auto& kv : loaded.named_parameters()) {
        EXPECT_EQ(kv.value().device(), dev) << kv.key();
        EXPECT_TRUE(torch::equal(kv.value().cpu(), want[kv.key()].cpu())) << kv.key() << (in_place ? " in place" : "");
      }
    }
  });
}

// A Comm that launches its collectives even over one rank (what the model skips: its one-rank
// collectives are copies), with side streams on or off.
detail::Comm launching_comm(const Rank& r, bool side_streams) {
  auto shared = std::make_shared<detail::CommShared>();
  shared->side_streams = side_streams;
  shared->launch_alone = true;
  return detail::Comm(r.pg, std::chrono::seconds(30), shared);
}

// On the GPU: an all-gather, a reduce-scatter and an all-reduce of inputs still being computed on
// the compute stream (a chain of matmuls queued just before) give the inputs' final values; with
// side streams they return an event and no work (asyncOp false), without them a work.
TEST(Cuda, CollectivesOnSideStreams) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  run_on_gpu([&](Rank& r) {
    const torch::Device dev(torch::kCUDA, 0);
    for (bool side : {true, false}) {
      detail::Comm comm = launching_comm(r, side);
      torch::manual_seed(0);
      const auto a = torch::randn({1024, 1024}, dev) / 32;
      auto in = a;
      for (int i = 0; i < 50; ++i) in = torch::tanh(in.matmul(a));  // still running when the collective is queued
      in = in.flatten();
      const auto want = in.clone();  // the same stream: its final values
      auto out = torch::empty_like(in);
      auto p = comm.all_gather_async(out, in, "the test's all-gather");
      EXPECT_EQ(p.event != nullptr, side);
      EXPECT_EQ(p.work.defined(), !side);
      comm.wait(p);
      EXPECT_TRUE(torch::equal(out, want)) << (side ? "side streams" : "NCCL's stream") << ": all-gather";
      auto rs_out = torch::empty_like(in);
      auto q = comm.reduce_scatter_sum_async(rs_out, out, "the test's reduce-scatter");
      comm.wait(q);
      EXPECT_TRUE(torch::equal(rs_out, want)) << "reduce-scatter";
      comm.all_reduce(rs_out, c10d::ReduceOp::SUM, "the test's all-reduce");
      EXPECT_TRUE(torch::equal(rs_out, want)) << "all-reduce";
    }
  });
}

// FullyShardOptions::device: a model built on the CPU ends up on the GPU, every parameter and
// buffer, whether fully_shard moves it whole or a ShardingScope moves each unit as it is built,
// and trains as plain LibTorch on the GPU from the same seed (1e-5); so does rank 0 of 8 over the
// fake process group (its collectives copies on the side streams), one step.
TEST(Cuda, DeviceOptionMovesTheModelBeforeSharding) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  run_on_gpu([&](Rank& r) {
    const torch::Device dev(torch::kCUDA, 0);
    auto on_gpu = [&](FSDPModule& model, const std::string& how) {
      for (const auto& kv : model.named_parameters()) EXPECT_EQ(kv.value().device(), dev) << how << ": " << kv.key();
      for (const auto& kv : model.named_buffers()) EXPECT_EQ(kv.value().device(), dev) << how << ": " << kv.key();
    };
    for (bool scoped : {true, false}) {
      const std::string how = scoped ? "in a ShardingScope" : "by fully_shard";
      torch::manual_seed(0);
      auto plain = gpt::make_gpt<false>(kCfg);
      plain->to(dev);
      torch::manual_seed(0);
      const auto options = test_options().device(dev);
      auto model = scoped ? [&] {
        ShardingScope scope(r.pg, options);
        return fsdp::fully_shard(gpt::make_gpt<true>(kCfg), scope);
      }()
                          : fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, options);
      on_gpu(model, how);
      torch::optim::AdamW ref_opt(plain->parameters(), torch::optim::AdamWOptions(1e-2));
      torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 3; ++step) {
        auto [x, y] = gpt_batch(kCfg, 6000 + step);
        ref_opt.zero_grad();
        auto ref_loss = gpt_loss(plain->forward(x.to(dev)), y.to(dev));
        ref_loss.backward();
        ref_opt.step();
        opt.zero_grad();
        auto loss = gpt_loss(model(x.to(dev)), y.to(dev));
        loss.backward();
        opt.step();
        EXPECT_TRUE(close(loss.detach().cpu(), ref_loss.detach().cpu(), 1e-5)) << how << ", step " << step;
      }
      on_gpu(model, how + ", after training");
    }
    ShardingScope scope(make_fake_process_group(0, 8), test_options().device(dev));
    auto fake = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), scope);
    on_gpu(fake, "rank 0 of 8");
    auto [x, y] = gpt_batch(kCfg, 7000);
    gpt_loss(fake(x.to(dev)), y.to(dev)).backward();
    for (const auto& p : fake.parameters()) EXPECT_TRUE(p.grad().defined() && p.grad().is_cuda());
  });
}

// The one-rank launch the test above relies on, over Gloo: the backend runs the collective and
// returns its work; without launch_alone the Comm copies and returns none.
TEST(Comm, LaunchAloneRunsTheBackendOverOneRank) {
  run_ranks(1, [&](Rank& r) {
    for (bool alone : {true, false}) {
      detail::Comm comm = launching_comm(r, true);
      comm.shared()->launch_alone = alone;
      auto in = torch::arange(12, torch::kFloat);
      auto out = torch::zeros({12});
      auto p = comm.all_gather_async(out, in, "the test's all-gather");
      EXPECT_EQ(p.work.defined(), alone) << "the backend ran it";
      EXPECT_EQ(p.event, nullptr) << "CPU tensors never go to side streams";
      comm.wait(p);
      EXPECT_TRUE(torch::equal(out, in));
      auto rs = torch::zeros({12});
      auto q = comm.reduce_scatter_sum_async(rs, out, "the test's reduce-scatter");
      EXPECT_EQ(q.work.defined(), alone);
      comm.wait(q);
      EXPECT_TRUE(torch::equal(rs, in));
      EXPECT_EQ(comm.stats().all_gathers, 1);
      EXPECT_EQ(comm.stats().reduce_scatters, 1);
    }
  });
}

}  // namespace
}  // namespace fsdp::testing
