// The order of a dataset in one epoch: a permutation of [0, n) that depends only on (seed, epoch),
// computed here from integer arithmetic alone, so that every standard library, compiler and
// machine gives the same order (std::shuffle and the std:: distributions do not: their algorithms
// are the library's choice), and any position of it is computed on its own, in O(1) time and no
// memory (a resume at sample 10^9 of a 10^9-sample epoch draws nothing before it).
//
//   fsdp::data::Permutation order(n, /*seed=*/1234, /*epoch=*/3);
//   for (int64_t i = 0; i < n; ++i) use(order(i));   // every index of [0, n) once
//
// The algorithm (docs/data.md, "The order", gives it in full with reference values): a 6-round
// balanced Feistel network on the smallest even number of bits b with 2^b >= n, whose round
// function is the SplitMix64 finalizer of the right half xor a round key derived from (seed,
// epoch); positions that land at or past n are encrypted again ("cycle walking") until they fall
// inside, which keeps it a permutation of [0, n). A keyed pseudo-random permutation, not a uniform
// draw among all n! orders, which no training loop needs.
#pragma once

#include "fsdp/export.h"

#include <array>
#include <cstdint>

FSDP_PUBLIC_BEGIN

namespace fsdp::data {

/// SplitMix64's finalizer (Steele, Lea, Flood 2014): a bijective mix of 64 bits.
uint64_t mix64(uint64_t z);

class Permutation {
 public:
  static constexpr int kRounds = 6;
  /// The order of [0, n) in `epoch` under `seed`; with shuffle false, the identity. n >= 0.
  Permutation(int64_t n, uint64_t seed, int64_t epoch, bool shuffle = true);
  /// The index at position i of the order, 0 <= i < n.
  int64_t operator()(int64_t i) const;
  int64_t size() const { return n_; }

 private:
  uint64_t encrypt(uint64_t x) const;
  int64_t n_;
  bool shuffle_;
  int half_bits_ = 1;
  uint64_t half_mask_ = 1;
  std::array<uint64_t, kRounds> keys_{};
};

}  // namespace fsdp::data

FSDP_PUBLIC_END
