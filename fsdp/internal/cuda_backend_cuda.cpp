// Built only when LibTorch has CUDA (see fsdp/CMakeLists.txt). Runs only where a GPU exists.
#include "fsdp/internal/cuda_backend.h"
#include "fsdp/internal/nccl_device.h"
#include "fsdp/internal/race_delay.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Sleep.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

namespace fsdp::detail {

bool maybe_add_nccl_backend(c10d::ProcessGroup& pg, const c10::intrusive_ptr<c10d::Store>& store, const LaunchEnv& env,
                            std::chrono::milliseconds timeout) {
  const int count = c10::cuda::device_count();
  if (count == 0) return false;
  const int device = nccl_device_index(env, count);
  // The GPU taken by its identity on this host, through the group's store: a second rank of the
  // group on the same GPU learns it here, from one atomic add, instead of from NCCL.
  std::array<char, 64> bus{};
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device));
  std::snprintf(bus.data(), bus.size(), "%04x:%02x:%02x.0", props->pciDomainID, props->pciBusID, props->pciDeviceID);
  std::array<char, 256> host{};
  if (::gethostname(host.data(), host.size() - 1) != 0) std::snprintf(host.data(), host.size(), "localhost");
  const int64_t holders = store->add(std::string("fsdp/gpu/") + host.data() + "/" + bus.data(), 1);
  // Set every time, so that a later process group of this process does not keep an old reason.
  nccl_absent_reason() = nccl_shared_gpu_refusal(env, host.data(), bus.data(), device, count, holders);
  if (!nccl_absent_reason().empty()) return false;  // the first CUDA collective says it (Comm::backend)
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  // On a timeout the watchdog aborts the communicators and marks the collective failed, without
  // ending the process from its thread (2: CleanUpOnly; PyTorch's default tears the process
  // down): the library reports it at its next wait with the usual message (Comm::wait_on_stream, Comm::wait_on_event).
  // A value the user set is kept.
  setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", /*overwrite=*/0);
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(c10::make_intrusive<c10d::PrefixStore>("nccl", store),
                                                          env.rank, env.world_size, opts);
  pg.setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
  return true;
}

namespace {

class CudaStreamEvent final : public StreamEvent {
 public:
  explicit CudaStreamEvent(c10::DeviceIndex device) : device_(device) {}
  ~CudaStreamEvent() override {
    if (waited_) return;
    try {
      block_current();
    } catch (...) {  // a destructor must not throw; a failed CUDA call is reported at the next one
    }
  }
  CudaStreamEvent(const CudaStreamEvent&) = delete;
  CudaStreamEvent& operator=(const CudaStreamEvent&) = delete;
  void record(const c10::cuda::CUDAStream& stream) { event_.record(stream); }
  void block_current() override {
    event_.block(c10::cuda::getCurrentCUDAStream(device_));
    waited_ = true;
  }

 private:
  c10::DeviceIndex device_;
  c10::cuda::CUDAEvent event_;  // no timing: the cheapest kind
  bool waited_ = false;
};

}  // namespace

// A model's streams per device and kind, from PyTorch's pool, high priority (as FSDP2's: a
// collective's kernels start ahead of queued compute).
class SideStreams {
 public:
  c10::cuda::CUDAStream get(c10::DeviceIndex device, SideStream which) {
    const std::lock_guard<std::mutex> lock(mu_);
    const std::pair<int, int> key{device, static_cast<int>(which)};
    auto it = streams_.find(key);
    if (it == streams_.end()) {
      it = streams_.emplace(key, c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)).first;
    }
    return it->second;
  }

 private:
  std::mutex mu_;
  std::map<std::pair<int, int>, c10::cuda::CUDAStream> streams_;
};

std::shared_ptr<SideStreams> make_side_streams() {
  return std::make_shared<SideStreams>();
}

bool nccl_blocking_wait() {
  return c10d::getCvarBool(c10d::TORCH_NCCL_BLOCKING_WAIT, false);
}

namespace {

// `side` starts after what `index`'s current stream queued so far: a collective's inputs' producers.
void after_current(const c10::cuda::CUDAStream& side, c10::DeviceIndex index) {
  c10::cuda::CUDAEvent inputs_ready;
  inputs_ready.record(c10::cuda::getCurrentCUDAStream(index));
  inputs_ready.block(side);
}

// Runs `fn` with `side` current and, with `record_end`, returns the event recorded after it (else
// null). If `fn` throws, the backend may have queued work on `side` before: the current stream
// waits for whatever `side` holds before the buffers can be given back, then the error goes on.
std::unique_ptr<StreamEvent> run_with_current(const c10::cuda::CUDAStream& side, c10::DeviceIndex index,
                                              const std::function<void()>& fn, bool record_end) {
  try {
    const c10::cuda::CUDAStreamGuard on_side(side);
    fn();
  } catch (...) {
    CudaStreamEvent queued(index);
    queued.record(side);
    queued.block_current();
    throw;
  }
  if (!record_end) return nullptr;
  auto done = std::make_unique<CudaStreamEvent>(index);
  done->record(side);
  return done;
}

}  // namespace

std::unique_ptr<StreamEvent> on_side_stream(SideStreams& streams, const c10::Device& device, SideStream which,
                                            const std::function<void()>& issue) {
  const c10::cuda::CUDAStream side = streams.get(device.index(), which);
  after_current(side, device.index());
  return run_with_current(side, device.index(), issue, /*record_end=*/true);
}

void issue_on_side_stream(SideStreams& streams, const c10::Device& device, SideStream which,
                          const std::function<void()>& issue) {
  const c10::cuda::CUDAStream side = streams.get(device.index(), which);
  after_current(side, device.index());
  // No end: Gloo records its own event on the side stream, after which it reads the inputs, and
  // writes the result later, from its worker thread (complete_on_side_stream orders it).
  run_with_current(side, device.index(), issue, /*record_end=*/false);
}

void on_pool_stream_for_testing(const c10::Device& device, const std::function<void()>& fn) {
  if (!device.is_cuda()) {
    fn();
    return;
  }
  const c10::cuda::CUDAStreamGuard on_pool(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index()));
  fn();
}

std::unique_ptr<StreamEvent> complete_on_side_stream(SideStreams& streams, const c10::Device& device, SideStream which,
                                                     const std::function<void()>& complete) {
  return run_with_current(streams.get(device.index(), which), device.index(), complete, /*record_end=*/true);
}

int cuda_device_count() {
  return static_cast<int>(c10::cuda::device_count());
}
int current_cuda_device() {
  return c10::cuda::device_count() > 0 ? static_cast<int>(c10::cuda::current_device()) : -1;
}
void set_cuda_device(int index) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
}

namespace {
class CudaHostSync final : public HostSync {
 public:
  explicit CudaHostSync(const c10::cuda::CUDAStream& stream) { event_.record(stream); }
  void synchronize() override { event_.synchronize(); }

 private:
  c10::cuda::CUDAEvent event_;
};
}  // namespace

std::unique_ptr<HostSync> record_host_sync(const c10::Device& device) {
  if (!device.is_cuda()) return nullptr;
  return std::make_unique<CudaHostSync>(c10::cuda::getCurrentCUDAStream(device.index()));
}

void sleep_current_stream(const c10::Device& device, std::chrono::microseconds duration) {
  if (!device.is_cuda() || duration.count() <= 0) return;
  // at::cuda::sleep spins a number of clock cycles on the current stream; about 1.5 cycles per
  // nanosecond on the GPUs this project runs on (the H100's and H200's boost clocks are 1.98 GHz,
  // their base clocks lower): the delays are random anyway, only their order of magnitude matters.
  const c10::cuda::CUDAGuard guard(device);
  at::cuda::sleep(duration.count() * 1500);
}

// The caching allocator's statistics exist only once CUDA is initialised (its first allocation, or
// this): asked first, as a measurement taken before the model moves to the GPU is, it refuses the
// device ("Invalid device argument").
namespace {
void init_cuda_for_stats(int device) {
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  TORCH_CHECK(device >= 0 && device < c10::cuda::device_count(), "fsdp::memory: cuda:", device,
              " is not a device of this machine (it has ", static_cast<int>(c10::cuda::device_count()),
              " CUDA devices): pass one of them");
}
}  // namespace

CudaMemory cuda_memory(int device) {
  if (c10::cuda::device_count() == 0) return {};
  init_cuda_for_stats(device);
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  const auto& s = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  return {s.current, s.peak};
}

void cuda_reset_peak(int device) {
  if (c10::cuda::device_count() == 0) return;
  init_cuda_for_stats(device);
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
}

}  // namespace fsdp::detail
