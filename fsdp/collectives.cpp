#include "fsdp/collectives.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <thread>

namespace fsdp::detail {

Comm::Comm(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::chrono::milliseconds timeout,
           std::shared_ptr<CommStats> stats)
    : stats_(std::move(stats)),
      pg_(std::move(pg)),
      timeout_(timeout),
      rank_(pg_->getRank()),
      world_size_(pg_->getSize()) {}

c10::intrusive_ptr<c10d::Backend> Comm::backend(const at::Tensor& t) const {
  try {
    return pg_->getBackend(t.device().type());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "fsdp: rank ", rank_, " has no communication backend for ", t.device(),
                " tensors (Gloo serves CPU, NCCL serves CUDA when a GPU is present): ", e.what());
  }
}

void Comm::wait(Pending& pending) const {
  if (!pending.work) return;
  auto work = std::move(pending.work);
  const std::string& what = pending.what;
  try {
    work->wait(timeout_);
    // Gloo's worker thread still holds the work, and with it the collective's tensors (and
    // staging copies), for a moment after wait() returns. Waiting for it to let go makes memory
    // the library frees really free when the next step allocates: the bounds in docs/design.md
    // hold in bytes. (NCCL's watchdog keeps its works much longer; CUDA memory is the caching
    // allocator's anyway.)
    if (pending.cpu) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
      while (work.use_count() > 1 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "fsdp: ", what, " failed on rank ", rank_, " of ", world_size_, " (timeout ", timeout_.count(),
                " ms): ", e.what(),
                "\nA peer rank may have exited, crashed, or taken a different path through the model; "
                "check every rank's output.");
  }
}

Pending Comm::all_gather_async(at::Tensor& out, at::Tensor& in, const std::string& what) {
  TORCH_INTERNAL_ASSERT(out.numel() == in.numel() * world_size_);
  ++stats_->all_gathers;
  stats_->elements += out.numel();
  if (world_size_ == 1) {
    out.copy_(in);
    return {nullptr, what};
  }
  return {backend(in)->_allgather_base(out, in), what, in.is_cpu()};
}

void Comm::all_gather(at::Tensor& out, at::Tensor& in, const std::string& what) {
  Pending p = all_gather_async(out, in, what);
  wait(p);
}

Pending Comm::reduce_scatter_sum_async(at::Tensor& out, at::Tensor& in, const std::string& what) {
  TORCH_INTERNAL_ASSERT(in.numel() == out.numel() * world_size_);
  ++stats_->reduce_scatters;
  stats_->elements += in.numel();
  if (world_size_ == 1) {
    out.copy_(in);
    return {nullptr, what};
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  return {backend(in)->_reduce_scatter_base(out, in, opts), what, in.is_cpu()};
}

Pending Comm::all_reduce_async(at::Tensor& t, c10d::ReduceOp op, const std::string& what) {
  ++stats_->all_reduces;
  stats_->elements += 2 * t.numel();
  if (world_size_ == 1) return {nullptr, what};
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = std::move(op);
  return {backend(t)->allreduce(ts, opts), what, t.is_cpu()};
}

void Comm::all_reduce(at::Tensor& t, c10d::ReduceOp op, const std::string& what) {
  Pending p = all_reduce_async(t, std::move(op), what);
  wait(p);
}

void Comm::broadcast(at::Tensor& t, int root, const std::string& what) {
  ++stats_->broadcasts;
  if (world_size_ == 1) return;
  std::vector<at::Tensor> ts{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  Pending p{backend(t)->broadcast(ts, opts), what, t.is_cpu()};
  wait(p);
}

}  // namespace fsdp::detail
