// The pipeline tests' microbatches: of different sequence lengths, each loss weighted by its tokens
// so that their sum is one process's mean over the step's tokens.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <utility>

namespace fsdp::testing {

/// Step `step`'s microbatch m of data-parallel rank d: `rows` rows of 4 + m tokens, and its targets.
inline std::pair<torch::Tensor, torch::Tensor> microbatch(int64_t step, int64_t m, int64_t vocab, int64_t rows,
                                                          int64_t d = 0) {
  torch::manual_seed(1000 * step + 100 * d + m);
  const auto t = torch::randint(vocab, {rows, 4 + m + 1});
  return {t.narrow(1, 0, 4 + m), t.narrow(1, 1, 4 + m)};
}

/// Microbatch m's share of the loss over `count` microbatches: its mean times its tokens over theirs.
inline double token_share(int64_t m, int64_t count) {
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) total += 4 + i;
  return static_cast<double>(4 + m) / static_cast<double>(total);
}

}  // namespace fsdp::testing
