#include "fsdp/memory.h"

#include "fsdp/internal/check.h"
#include "fsdp/internal/cuda_backend.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace fsdp::memory {
namespace {

// Wraps the CPU allocator that was installed before it, counting the bytes of every allocation
// until it is freed, whichever thread or tensor releases it. Each DataPtr's context is its data
// pointer, as the default CPU allocator's: oneDNN (bf16 matmuls on CPUs with AMX or AVX512-BF16)
// allocates through raw_allocate / raw_deallocate, which require that. The inner allocation and
// its size wait in a table keyed by the pointer.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // zero bytes: nothing to count or to free
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      live_.emplace(data, Live{std::move(inner), static_cast<int64_t>(n)});
    }
    add(static_cast<int64_t>(n));
    return {data, data, &CountingAllocator::release, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  Stats stats() const { return {current_.load(), peak_.load()}; }
  void reset_peak() { peak_.store(current_.load()); }

 private:
  struct Live {
    c10::DataPtr inner;
    int64_t bytes;
  };

  static void release(void* p);

  void forget(void* p) {
    c10::DataPtr inner;  // freed as it leaves this scope, outside the lock
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(p);
      if (it != live_.end()) {
        inner = std::move(it->second.inner);
        current_.fetch_sub(it->second.bytes);
        live_.erase(it);
        return;
      }
    }
    // Allocated before counting began (oneDNN looks the allocator up when it frees): the
    // allocator that made it frees it.
    if (c10::DeleterFnPtr d = inner_->raw_deleter()) d(p);
  }

  void add(int64_t n) {
    int64_t now = current_.fetch_add(n) + n;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }

  c10::Allocator* inner_;
  std::mutex mutex_;
  std::unordered_map<void*, Live> live_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

CountingAllocator* g_counting = nullptr;
std::once_flag g_once;

void CountingAllocator::release(void* p) {
  g_counting->forget(p);
}

}  // namespace

void enable_cpu_counting() {
  std::call_once(g_once, [] {
    // Never freed: tensors allocated through it may outlive main().
    g_counting = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(g_counting, /*priority=*/100);
  });
}

bool cpu_counting_enabled() {
  return g_counting != nullptr;
}

Stats stats(c10::Device device) {
  if (device.is_cuda()) {
    auto m = detail::cuda_memory(device.has_index() ? device.index() : 0);
    return {m.current, m.peak};
  }
  FSDP_CHECK(device.is_cpu(), "fsdp::memory::stats: unsupported device ", device);
  FSDP_CHECK(g_counting != nullptr,
             "fsdp::memory::stats: CPU memory is not being counted; call fsdp::memory::enable_cpu_counting() "
             "at the start of main(), before any tensor is created.");
  return g_counting->stats();
}

void reset_peak(c10::Device device) {
  if (device.is_cuda()) {
    detail::cuda_reset_peak(device.has_index() ? device.index() : 0);
    return;
  }
  if (g_counting != nullptr) g_counting->reset_peak();
}

}  // namespace fsdp::memory

// The same CPU counting from processes that load libtorch_fsdp.so by name, such as Python through
// ctypes after `import torch` (the library then shares that process's LibTorch): the benchmark
// measures PyTorch's own FSDP with the allocator it measures this library with. Exported C symbols
// only, declared nowhere public: they are not part of the C++ API.
extern "C" {
__attribute__((visibility("default"))) void fsdp_memory_enable_cpu_counting();
__attribute__((visibility("default"))) int64_t fsdp_memory_cpu_current_bytes();  // -1 when counting is off
__attribute__((visibility("default"))) int64_t fsdp_memory_cpu_peak_bytes();     // -1 when counting is off
__attribute__((visibility("default"))) void fsdp_memory_reset_cpu_peak();
void fsdp_memory_enable_cpu_counting() {
  fsdp::memory::enable_cpu_counting();
}
int64_t fsdp_memory_cpu_current_bytes() {
  return fsdp::memory::cpu_counting_enabled() ? fsdp::memory::stats().current_bytes : -1;
}
int64_t fsdp_memory_cpu_peak_bytes() {
  return fsdp::memory::cpu_counting_enabled() ? fsdp::memory::stats().peak_bytes : -1;
}
void fsdp_memory_reset_cpu_peak() {
  fsdp::memory::reset_peak();
}
}
