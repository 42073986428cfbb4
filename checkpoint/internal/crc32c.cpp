#include "checkpoint/internal/crc32c.h"

#include <array>
#include <cstring>

namespace fsdp::checkpoint {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78;  // 0x1EDC6F41, bit-reflected

// Slicing by 8: table k gives the CRC of a byte followed by k zero bytes.
struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int b = 0; b < 8; ++b) c = (c & 1) != 0 ? (c >> 1) ^ kPolynomial : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (size_t k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

// `c` is the running (inverted) value.
uint32_t portable(const uint8_t* p, size_t n, uint32_t c) {
  const auto& t = tables().t;
  while (n >= 8) {
    uint64_t w = 0;
    std::memcpy(&w, p, 8);  // little-endian: byte 0 is the lowest
    w ^= c;
    c = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
        t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = t[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t hardware(const uint8_t* p, size_t n, uint32_t c) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t w = 0;
    std::memcpy(&w, p, 8);
    c64 = __builtin_ia32_crc32di(c64, w);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<uint32_t>(c64);
  while (n-- > 0) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}

bool have_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2") != 0;
  return yes;
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
#if defined(__x86_64__)
  if (have_sse42()) return ~hardware(p, n, ~crc);
#endif
  return ~portable(p, n, ~crc);
}

namespace detail {
uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc) {
  return ~portable(static_cast<const uint8_t*>(data), n, ~crc);
}
}  // namespace detail

}  // namespace fsdp::checkpoint
