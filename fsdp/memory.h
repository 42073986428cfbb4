// Live and peak bytes per rank: on CPU through a counting allocator, on CUDA from the caching
// allocator's statistics.
#pragma once

#include "fsdp/export.h"

#include <c10/core/Device.h>

#include <cstdint>

FSDP_PUBLIC_BEGIN

namespace fsdp::memory {

/// Installs the counting CPU allocator (idempotent). Only allocations made after this call are
/// counted, so call it first thing in main(), before building the model.
void enable_cpu_counting();
bool cpu_counting_enabled();

struct Stats {
  int64_t current_bytes = 0;  ///< bytes allocated now
  int64_t peak_bytes = 0;     ///< most bytes allocated at once since the last reset_peak()
};

/// Statistics for a device: CPU (needs enable_cpu_counting()) or a CUDA device.
Stats stats(c10::Device device = c10::Device(c10::kCPU));
/// Sets the peak to the current value.
void reset_peak(c10::Device device = c10::Device(c10::kCPU));

}  // namespace fsdp::memory

FSDP_PUBLIC_END
