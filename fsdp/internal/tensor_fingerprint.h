// A fingerprint of a tensor's bytes as this rank holds them, to compare with another rank's copy
// of what should be the same values (a parameter the tensor-parallel ranks hold alike) without
// sending the tensor: 64 bits, FNV-style over 8-byte words. Internal to the library.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>

namespace fsdp::detail {

inline uint64_t tensor_fingerprint(const at::Tensor& t) {
  const at::Tensor c = t.detach().cpu().contiguous();
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  const size_t n = c.nbytes();
  uint64_t h = 1469598103934665603ull;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w = 0;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 1099511628211ull;
    h ^= h >> 29;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h ^ n;
}

}  // namespace fsdp::detail
