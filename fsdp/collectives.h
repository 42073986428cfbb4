// The collectives the sharding core issues, with their counts, a timeout on every wait, and errors
// that say which operation failed on which rank. Internal to the library.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace fsdp {

/// What the library sent through the process group since the last reset. `elements` is the ZeRO
/// paper's communication volume: all-gather output + reduce-scatter input + 2 x all-reduce elements.
struct CommStats {
  int64_t all_gathers = 0;
  int64_t reduce_scatters = 0;
  int64_t all_reduces = 0;
  int64_t broadcasts = 0;
  int64_t elements = 0;
};

namespace detail {

/// A collective in flight: wait() before touching its tensors.
struct Pending {
  c10::intrusive_ptr<c10d::Work> work;  // null when there was nothing to wait for (one rank)
  std::string what;
  bool cpu = false;  // Gloo: wait() also waits for the worker thread to drop the work
};

class Comm {
 public:
  /// `stats` may be shared between the Comms of one model (hybrid sharding's groups).
  Comm(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::chrono::milliseconds timeout,
       std::shared_ptr<CommStats> stats = std::make_shared<CommStats>());

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return pg_; }

  /// out[r * in.numel() + i] = in_r[i] for every rank r (rank-major).
  void all_gather(at::Tensor& out, at::Tensor& in, const std::string& what);
  /// The same, returning at once; `out` and `in` must stay alive and untouched until wait().
  Pending all_gather_async(at::Tensor& out, at::Tensor& in, const std::string& what);
  /// out = (sum over ranks of in)[rank * out.numel(), (rank + 1) * out.numel()).
  /// Gloo may implement this as an all-reduce; SUM is used because some versions turn AVG into SUM.
  Pending reduce_scatter_sum_async(at::Tensor& out, at::Tensor& in, const std::string& what);
  /// Waits for a pending collective (with the timeout); throws naming it on failure.
  void wait(Pending& pending) const;
  void all_reduce(at::Tensor& t, c10d::ReduceOp op, const std::string& what);
  Pending all_reduce_async(at::Tensor& t, c10d::ReduceOp op, const std::string& what);
  void broadcast(at::Tensor& t, int root, const std::string& what);

  CommStats& stats() const { return *stats_; }
  const std::shared_ptr<CommStats>& shared_stats() const { return stats_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  std::shared_ptr<CommStats> stats_;
  c10::intrusive_ptr<c10d::Backend> backend(const at::Tensor& t) const;

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::chrono::milliseconds timeout_;
  int rank_;
  int world_size_;
};

}  // namespace detail
}  // namespace fsdp
