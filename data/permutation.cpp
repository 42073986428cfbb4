#include "data/permutation.h"

#include "fsdp/internal/check.h"

namespace fsdp::data {

namespace {
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;  // 2^64 / the golden ratio, SplitMix64's increment
}

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

Permutation::Permutation(int64_t n, uint64_t seed, int64_t epoch, bool shuffle) : n_(n), shuffle_(shuffle) {
  FSDP_CHECK(n >= 0, "fsdp::data::Permutation: a dataset of ", n, " samples; the size must be >= 0.");
  FSDP_CHECK(n <= (int64_t{1} << 62), "fsdp::data::Permutation: a dataset of ", n,
             " samples; at most 2^62 are supported.");
  FSDP_CHECK(epoch >= 0, "fsdp::data::Permutation: epoch ", epoch, "; epochs count from 0.");
  // b: the smallest even number of bits (at least 2) whose range holds n, so that the two halves
  // are equal and the range is less than 4n: cycle walking takes fewer than 4 rounds on average.
  int bits = 2;
  while ((uint64_t{1} << bits) < static_cast<uint64_t>(n)) bits += 2;
  half_bits_ = bits / 2;
  half_mask_ = (uint64_t{1} << half_bits_) - 1;
  // Round keys: the seed and the epoch each mixed, so that nearby seeds or epochs share nothing.
  const uint64_t s = mix64(seed), e = mix64(static_cast<uint64_t>(epoch) + kGolden);
  for (int r = 0; r < kRounds; ++r) keys_[r] = mix64(s ^ (e + static_cast<uint64_t>(r) * kGolden));
}

uint64_t Permutation::encrypt(uint64_t x) const {
  uint64_t left = x >> half_bits_, right = x & half_mask_;
  for (const uint64_t key : keys_) {
    const uint64_t next = left ^ (mix64(right ^ key) & half_mask_);
    left = right;
    right = next;
  }
  return (left << half_bits_) | right;
}

int64_t Permutation::operator()(int64_t i) const {
  FSDP_CHECK(i >= 0 && i < n_, "fsdp::data::Permutation: position ", i, " is outside [0, ", n_, ").");
  if (!shuffle_) return i;
  // The range [0, 2^b) holds [0, n); walking the cycle of i through it until it lands below n
  // stays a bijection on [0, n), and ends, since i itself is on that cycle.
  uint64_t x = static_cast<uint64_t>(i);
  do {
    x = encrypt(x);
  } while (x >= static_cast<uint64_t>(n_));
  return static_cast<int64_t>(x);
}

}  // namespace fsdp::data
