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

// Shifting a CRC over zero bytes is linear over GF(2): the register after `len` zero bytes is a
// 32 x 32 bit matrix times the register, tabulated per byte of the register (4 x 256 entries).
// It joins CRCs of consecutive pieces computed independently: crc(A || B) = shift_|B|(crc(A)) ^
// crc_from_0(B) (Mark Adler's method, crc32c.c).
struct Shift {
  std::array<std::array<uint32_t, 256>, 4> t{};
  explicit Shift(size_t len) {
    // The operator of one zero bit, then squared into 2, 4, 8, ... bits until `len` bytes.
    std::array<uint32_t, 32> odd{}, even{};
    odd[0] = kPolynomial;
    for (uint32_t n = 1, row = 1; n < 32; ++n, row <<= 1) odd[n] = row;
    square(even, odd);  // 2 bits
    square(odd, even);  // 4 bits
    std::array<uint32_t, 32>* op = &odd;
    for (size_t bits = len * 8 / 4; bits > 1; bits >>= 1) {  // len is a power of two
      std::array<uint32_t, 32>& from = *op;
      std::array<uint32_t, 32>& to = op == &odd ? even : odd;
      square(to, from);
      op = &to;
    }
    for (uint32_t n = 0; n < 256; ++n) {
      for (int k = 0; k < 4; ++k) t[k][n] = times(*op, n << (8 * k));
    }
  }
  static uint32_t times(const std::array<uint32_t, 32>& mat, uint32_t vec) {
    uint32_t sum = 0;
    for (size_t i = 0; vec != 0; vec >>= 1, ++i) {
      if ((vec & 1) != 0) sum ^= mat[i];
    }
    return sum;
  }
  static void square(std::array<uint32_t, 32>& out, const std::array<uint32_t, 32>& mat) {
    for (size_t n = 0; n < 32; ++n) out[n] = times(mat, mat[n]);
  }
  uint32_t operator()(uint32_t crc) const {
    return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24];
  }
};

#if defined(__x86_64__)
// The crc32 instruction takes 3 cycles but a new one can start every cycle: three independent
// streams (thirds of a 3 x 8 KiB, then 3 x 256 B, stretch) keep it busy, joined by Shift. About 3
// times one stream's speed; the checkpoint computes a CRC of every byte it saves and loads.
template <size_t kLen>
__attribute__((target("sse4.2"))) uint64_t three_streams(const uint8_t*& p, size_t& n, uint64_t c0) {
  static const Shift shift(kLen);
  while (n >= 3 * kLen) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < kLen; i += 8) {
      uint64_t w0 = 0, w1 = 0, w2 = 0;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p + kLen + i, 8);
      std::memcpy(&w2, p + 2 * kLen + i, 8);
      c0 = __builtin_ia32_crc32di(c0, w0);
      c1 = __builtin_ia32_crc32di(c1, w1);
      c2 = __builtin_ia32_crc32di(c2, w2);
    }
    c0 = shift(static_cast<uint32_t>(c0)) ^ c1;
    c0 = shift(static_cast<uint32_t>(c0)) ^ c2;
    p += 3 * kLen;
    n -= 3 * kLen;
  }
  return c0;
}

__attribute__((target("sse4.2"))) uint32_t hardware(const uint8_t* p, size_t n, uint32_t c) {
  uint64_t c64 = c;
  c64 = three_streams<8192>(p, n, c64);
  c64 = three_streams<256>(p, n, c64);
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
