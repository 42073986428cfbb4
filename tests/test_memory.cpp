// Memory accounting: the counting allocator measures exact bytes, and wrapping really replaces a
// model's full parameters by this rank's padded shards. Expected bytes come from shapes.
#include "tests/models.h"

#include <gtest/gtest-spi.h>

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
    // Left: shards + this rank's gradient shards (same padded size).
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
