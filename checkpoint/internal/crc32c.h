// CRC32C (Castagnoli), the checksum of the checkpoint format (docs/checkpoint-format.md): the one
// iSCSI, ext4 and Google's formats use, with an instruction of its own on x86-64 (SSE 4.2).
#pragma once

#include "fsdp/export.h"

#include <cstddef>
#include <cstdint>

namespace fsdp::checkpoint {

/// CRC32C of `n` bytes at `data`, continuing from `crc` (0 to start), so that
/// crc32c(b, nb, crc32c(a, na)) is the CRC32C of a followed by b. crc32c("123456789") = 0xE3069283.
FSDP_TESTING_API uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

namespace detail {
/// The same without the CPU instruction (table-driven, 8 bytes at a time); crc32c() uses it where
/// SSE 4.2 is missing. For tests.
FSDP_TESTING_API uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc = 0);
}  // namespace detail

}  // namespace fsdp::checkpoint
