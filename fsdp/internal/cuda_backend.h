// The CUDA-only pieces, compiled where LibTorch has CUDA (cuda_backend_cuda.cpp; elsewhere
// cuda_backend_none.cpp reports "no CUDA"): the NCCL backend, caching-allocator statistics, the
// side streams collectives run on, the events (StreamEvent) and host syncs (HostSync) that order
// them with the compute stream, and how NCCL's blocking wait is read.
#pragma once

#include "fsdp/export.h"
#include "fsdp/process_group.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

namespace fsdp::detail {

/// Adds an NCCL backend for CUDA tensors to `pg` if CUDA and a GPU are present; binds this process
/// to GPU `env.local_rank`. A local rank without a GPU of its own gets none, and the reason is kept
/// for its first CUDA collective (fsdp/internal/nccl_device.h). Returns whether it did.
bool maybe_add_nccl_backend(c10d::ProcessGroup& pg, const c10::intrusive_ptr<c10d::Store>& store, const LaunchEnv& env,
                            std::chrono::milliseconds timeout);

/// The CUDA devices this process sees (0 without CUDA), its current one (-1 without CUDA), and
/// binding it to one (nothing without CUDA): fsdp::cuda_device, the Gloo testing mode.
int cuda_device_count();
int current_cuda_device();
void set_cuda_device(int index);

/// FSDP2's communication streams: all-gathers on one, gradient reductions on another, so that a
/// prefetched all-gather never queues behind a reduce-scatter on the backend's single stream.
enum class SideStream { kAllGather = 0, kReduce = 1 };

/// One model's side streams (per device and kind, taken from PyTorch's pool when first used), so
/// that two models' collectives never queue behind each other. Null without CUDA.
class SideStreams;
FSDP_TESTING_API std::shared_ptr<SideStreams> make_side_streams();

/// Whether ProcessGroupNCCL waits blockingly (TORCH_NCCL_BLOCKING_WAIT or NCCL_BLOCKING_WAIT, read
/// as it reads them): its watchdog then tracks no collective, so side streams, which return no
/// work to wait on, would lose the timeout. False without CUDA.
FSDP_TESTING_API bool nccl_blocking_wait();

/// The end of a collective issued on a side stream. block_current() makes the stream current
/// then wait for it (never the CPU); destroyed without that, it does so itself, so that the
/// collective's buffers, freed after it, are never reused under the collective.
class StreamEvent {
 public:
  virtual ~StreamEvent() = default;
  virtual void block_current() = 0;
};

/// Runs `issue` (which launches a collective with asyncOp false: on the current stream) with side
/// stream `which` of `device` current, after making that stream wait for what the current stream
/// has queued (the collective's inputs); returns the event recorded after it. CUDA builds only.
std::unique_ptr<StreamEvent> on_side_stream(SideStreams& streams, const c10::Device& device, SideStream which,
                                            const std::function<void()>& issue);

/// Gloo's CUDA collectives (the testing mode of several ranks on one GPU, docs/usage.md): `issue`
/// runs with side stream `which` current, after what the current stream has queued (as
/// on_side_stream), but no end is recorded: Gloo writes the result later, from its worker thread.
/// complete_on_side_stream then runs `complete` (the work's wait(), which orders that write, and
/// for a reduce-scatter performs its copy, on the stream current then) with the side stream
/// current, and returns the event after it. CUDA builds only.
void issue_on_side_stream(SideStreams& streams, const c10::Device& device, SideStream which,
                          const std::function<void()>& issue);
std::unique_ptr<StreamEvent> complete_on_side_stream(SideStreams& streams, const c10::Device& device, SideStream which,
                                                     const std::function<void()>& complete);

/// A point in the current stream of a CUDA device that the CPU can wait for (CPU offload): recorded
/// after an asynchronous copy between pinned host memory and the device, so that the CPU reads a
/// host buffer the copy writes, or writes one the copy reads, only once the copy has passed.
class HostSync {
 public:
  virtual ~HostSync() = default;
  /// Blocks the CPU until the stream has reached the point (throws on a CUDA error).
  virtual void synchronize() = 0;
};
/// Records one on `device`'s current stream; null for a CPU device (copies there are synchronous).
std::unique_ptr<HostSync> record_host_sync(const c10::Device& device);

/// Queues a kernel that spins about `duration` on `device`'s current stream (the race switch's
/// delays, fsdp/internal/race_delay.h). Nothing for a CPU device or a zero duration.
void sleep_current_stream(const c10::Device& device, std::chrono::microseconds duration);

struct CudaMemory {
  int64_t current = 0;
  int64_t peak = 0;
};
/// The caching allocator's allocated bytes on `device` (zeros without CUDA).
CudaMemory cuda_memory(int device);
void cuda_reset_peak(int device);

}  // namespace fsdp::detail
