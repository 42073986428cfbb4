// Memory accounting: the counting allocator measures exact bytes, and wrapping really replaces a
// model's full parameters by this rank's padded shards. Expected bytes come from shapes.
#include "tests/models.h"

#include <gtest/gtest-spi.h>

#include <iostream>
#include <thread>

namespace fsdp::testing {
namespace {

/// Current bytes once they equal `expected`, or after 2 s. Gloo's worker thread drops its reference
/// to a collective's tensors a moment after the collective completes, so memory the library has
/// already released can still be live for that moment.
int64_t settled_bytes(int64_t expected) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  int64_t now = fsdp::memory::stats().current_bytes;
  while (now != expected && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    now = fsdp::memory::stats().current_bytes;
  }
  return now;
}

TEST(Memory, CountingAllocatorIsExact) {
  fsdp::memory::enable_cpu_counting();
  ASSERT_TRUE(fsdp::memory::cpu_counting_enabled());
  const int64_t base = fsdp::memory::stats().current_bytes;
  fsdp::memory::reset_peak();
  {
    auto a = torch::empty({1000}, torch::kFloat);  // 4000 bytes
    auto b = torch::empty({250}, torch::kDouble);  // 2000 bytes
    EXPECT_EQ(fsdp::memory::stats().current_bytes - base, 6000);
  }
  EXPECT_EQ(fsdp::memory::stats().current_bytes, base);
  EXPECT_EQ(fsdp::memory::stats().peak_bytes - base, 6000);
  fsdp::memory::reset_peak();
  EXPECT_EQ(fsdp::memory::stats().peak_bytes, base);
}

TEST(Memory, WrappingKeepsOnlyThisRanksPaddedShards) {
  run_ranks(3, [](Rank& r) {
    fsdp::memory::enable_cpu_counting();
    gpt::Config cfg;
    cfg.vocab_size = 31;
    cfg.block_size = 8;
    cfg.n_layer = 2;
    cfg.n_head = 2;
    cfg.n_embd = 10;
    int64_t full = 0, shards = 0;  // bytes, from shapes
    {
      auto shapes = gpt::make_gpt<false>(cfg);
      for (const auto& p : shapes->parameters()) {
        const int64_t rows = p.dim() == 0 ? 1 : p.size(0);
        full += p.numel() * 4;
        shards += (rows + r.world_size - 1) / r.world_size * (p.numel() / rows) * 4;
      }
    }
    auto tok = torch::randint(cfg.vocab_size, {2, cfg.block_size}, torch::kLong);
    const int64_t c0 = fsdp::memory::stats().current_bytes;
    auto plain = gpt::make_gpt<true>(cfg);
    EXPECT_EQ(fsdp::memory::stats().current_bytes - c0, full);
    auto model = fsdp::fully_shard(plain, r.pg, test_options());
    EXPECT_EQ(settled_bytes(c0 + shards) - c0, shards);
    // A forward gathers units and frees them again; the root stays gathered until backward.
    model(tok).sum().backward();
    // Left: shards + this rank's gradient shards (same padded size), and the buffers kept for the
    // next step (not model state), within their cap; released on request.
    const fsdp::BufferCacheStats cache = model.buffer_cache_stats();
    EXPECT_GT(cache.cached_bytes, 0);
    EXPECT_LE(cache.cached_bytes, cache.cap_bytes);
    EXPECT_EQ(settled_bytes(c0 + 2 * shards + cache.cached_bytes) - c0 - cache.cached_bytes, 2 * shards);
    model.release_cached_buffers();
    EXPECT_EQ(model.buffer_cache_stats().cached_bytes, 0);
    EXPECT_EQ(settled_bytes(c0 + 2 * shards) - c0, 2 * shards);
  });
}

// The harness itself: a crashed or hanging rank fails the test, within the time limit.
void CrashingRun() {
  run_ranks(2, [](Rank& r) {
    if (r.rank == 1) std::abort();
  });
}
void HangingRun() {
  RunOptions o;
  o.timeout = std::chrono::seconds(8);
  run_ranks(
      2,
      [](Rank& r) {
        if (r.rank == 1) std::this_thread::sleep_for(std::chrono::hours(1));
      },
      o);
}

TEST(Harness, CrashedRankFailsTheTest) {
  EXPECT_FATAL_FAILURE(CrashingRun(), "rank 1 of 2: killed by signal 6");
}
TEST(Harness, HangingRankIsKilled) {
  EXPECT_FATAL_FAILURE(HangingRun(), "rank 1 of 2: did not finish in time");
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing {
namespace {

/// Units of different sizes, so that "the two largest" is a real choice; a small root head.
struct WideChainImpl : torch::nn::Module {
  static constexpr int64_t kWidths[] = {8, 24, 40, 16, 8};
  WideChainImpl() : head(register_module("head", torch::nn::Linear(8, 3))) {
    for (int i = 0; i < 4; ++i) {
      units.push_back(
          register_module("u" + std::to_string(i), fsdp::Sharded<torch::nn::LinearImpl>(kWidths[i], kWidths[i + 1])));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& u : units) x = torch::tanh(u(x));
    return head(x);
  }
  std::vector<fsdp::Sharded<torch::nn::LinearImpl>> units;
  torch::nn::Linear head;
};

/// Unsharded bytes of a Linear(in, out) unit at W ranks: each parameter padded to W * ceil(rows/W) rows.
int64_t unit_bytes(int64_t in, int64_t out, int W) {
  return W * (row_layout({out, in}, W).padded_numel() + row_layout({out}, W).padded_numel()) * 4;
}

// In forward, memory beyond the shards stays within the root unit plus the
// two largest other units (the one computing and the one prefetched), plus activations.
void check_forward_peak(Rank& r, int prefetch) {
  fsdp::memory::enable_cpu_counting();
  const int W = r.world_size;
  int64_t root = unit_bytes(8, 3, W), largest = 0, second = 0;
  int64_t activations = 0;  // every activation of the forward, all alive at once: an upper bound
  const int64_t batch = 2;
  for (int i = 0; i < 4; ++i) {
    const int64_t b = unit_bytes(WideChainImpl::kWidths[i], WideChainImpl::kWidths[i + 1], W);
    if (b > largest) {
      second = largest;
      largest = b;
    } else if (b > second) {
      second = b;
    }
    activations += 2 * batch * WideChainImpl::kWidths[i + 1] * 4;  // Linear output and tanh output
  }
  activations += batch * 3 * 4;
  auto model = fsdp::fully_shard(std::make_shared<WideChainImpl>(), r.pg, test_options().prefetch(prefetch));
  auto x = torch::randn({batch, 8});
  model(x).sum().backward();  // step 1 records the unit order that prefetch follows
  for (const auto& p : model.parameters()) p.mutable_grad() = torch::Tensor();
  // From an empty cache: what the forward allocates is then all there (kept buffers count as
  // allocated, up to their cap, beyond the live bound).
  model.release_cached_buffers();
  const int64_t cap = model.buffer_cache_stats().cap_bytes;

  const int64_t base = fsdp::memory::stats().current_bytes;
  const int64_t held = model.held_state_bytes();
  fsdp::memory::reset_peak();
  model.track_state_peak(true);
  auto out = model(x);
  const int64_t peak = fsdp::memory::stats().peak_bytes - base;
  const int64_t live_peak = model.state_peak_bytes() - held;
  // The design bound: a unit's all-gather output and its unsharded storage are alive together
  // during its copy-out (and the next unit's gather output only after that), so beyond the shards
  // at most the root plus twice the largest unit is gathered.
  const int64_t bound = root + 2 * largest;
  // Gloo stages an all-gather through a flat temporary the size of its output, released when its
  // worker thread drops the finished work. Comm::wait waits for that (up to 50 ms), so this
  // allowance (two such: the last and the one in flight) only covers a wait that gave up.
  const int64_t gloo_staging = 2 * largest;
  EXPECT_LE(live_peak, bound) << "prefetch " << prefetch << ": live peak " << live_peak << ", bound " << bound;
  EXPECT_EQ(cap, 2 * (prefetch + 2) * largest);
  EXPECT_LE(peak, bound + cap + gloo_staging + activations)
      << "prefetch " << prefetch << ": peak " << peak << ", bound " << bound << " + cache cap " << cap
      << " + Gloo staging " << gloo_staging << " + activations " << activations;
  std::cout << "rank " << r.rank << ", prefetch " << prefetch << ": forward peak above the shards " << peak
            << " bytes (live " << live_peak << "); bound: root " << root << " + 2 x largest unit " << largest << " = "
            << bound << ", + cache cap " << cap << " + Gloo staging " << gloo_staging << " + activations (upper bound) "
            << activations << " = " << bound + cap + gloo_staging + activations << std::endl;
  // And the gathered memory is really there: at least the root and one unit.
  EXPECT_GE(peak, root + second);
  out.sum().backward();
}

TEST(Memory, ForwardPeakWithinBoundWithPrefetch) {
  run_ranks(2, [](Rank& r) { check_forward_peak(r, 1); });
}
TEST(Memory, ForwardPeakWithinBoundWithoutPrefetch) {
  run_ranks(2, [](Rank& r) { check_forward_peak(r, 0); });
}

/// Four units of one size and a smaller root head.
struct EqualChainImpl : torch::nn::Module {
  static constexpr int kUnits = 4;
  EqualChainImpl() : head(register_module("head", torch::nn::Linear(16, 3))) {
    for (int i = 0; i < kUnits; ++i) {
      units.push_back(register_module("u" + std::to_string(i), fsdp::Sharded<torch::nn::LinearImpl>(16, 16)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& u : units) x = torch::tanh(u(x));
    return head(x);
  }
  std::vector<fsdp::Sharded<torch::nn::LinearImpl>> units;
  torch::nn::Linear head;
};

// No per-step reallocation: from the second step on, every buffer a step takes (per non-root unit:
// the all-gather output and the unsharded storage in forward and again in backward, and the packed
// gradients; the root, gathered once: three) comes from the cache, and nothing new is allocated.
TEST(Memory, StepsReuseTheirBuffers) {
  run_ranks(2, [](Rank& r) {
    const int U = EqualChainImpl::kUnits;
    auto model = fsdp::fully_shard(std::make_shared<EqualChainImpl>(), r.pg, test_options());
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    auto x = torch::randn({2, 16});
    fsdp::BufferCacheStats last;
    for (int step = 0; step < 5; ++step) {
      opt.zero_grad();
      model(x).sum().backward();
      opt.step();
      const fsdp::BufferCacheStats now = model.buffer_cache_stats();
      EXPECT_EQ(now.reused + now.allocated - last.reused - last.allocated, 3 + 5 * U) << "step " << step;
      if (step >= 2) {
        EXPECT_EQ(now.allocated, last.allocated) << "step " << step << " allocated new buffers";
        EXPECT_EQ(now.reused - last.reused, 3 + 5 * U) << "step " << step;
      }
      EXPECT_LE(now.cached_bytes, now.cap_bytes);
      last = now;
    }
    // The cap: 2 x (prefetch + 2) buffers of the largest unit (Linear(16, 16) over 2 ranks).
    EXPECT_EQ(last.cap_bytes, 2 * 3 * unit_bytes(16, 16, r.world_size));
  });
}

}  // namespace
}  // namespace fsdp::testing
