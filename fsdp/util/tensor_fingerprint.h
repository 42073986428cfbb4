// A fingerprint of a tensor's bytes as this rank holds them, to compare with another rank's copy
// of what should be the same values (a parameter the tensor-parallel ranks hold alike) without
// sending the tensor: 64 bits, FNV-style over 8-byte words; and the text ranks exchange to compare
// several (fully_shard's check at wrapping, a checkpoint's before it writes). Internal to the
// library.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::util {

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

/// "<name> <fingerprint>\n" per tensor, in order.
inline std::string fingerprint_lines(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::string out;
  for (const auto& [name, t] : tensors) out += name + " " + std::to_string(tensor_fingerprint(t)) + "\n";
  return out;
}

/// The name on the first line where two fingerprint_lines() texts differ ("" when none does).
inline std::string first_difference(const std::string& a, const std::string& b) {
  for (size_t i = 0, j = 0; i < a.size() || j < b.size();) {
    const size_t ei = std::min(a.find('\n', i), a.size()), ej = std::min(b.find('\n', j), b.size());
    if (a.compare(i, ei - i, b, j, ej - j) != 0) {
      const std::string line = i < a.size() ? a.substr(i, ei - i) : b.substr(j, ej - j);
      return line.substr(0, line.rfind(' '));
    }
    i = ei + 1;
    j = ej + 1;
  }
  return "";
}

}  // namespace fsdp::util
