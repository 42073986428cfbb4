#include "fsdp/fake_process_group.h"

#include "fsdp/env.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/comm.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

namespace fsdp {
namespace {

// Completed when created: nothing is in flight.
class DoneWork final : public c10d::Work {
 public:
  DoneWork() { finish(); }
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
};

class FakeBackend final : public c10d::Backend {
 public:
  FakeBackend(int rank, int size) : Backend(rank, size) {}
  const std::string getBackendName() const override { return "fake"; }
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return c10::make_intrusive<Options>("fake", default_timeout());
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& /*opts*/) override {
    FSDP_CHECK(out.numel() == in.numel() * getSize(), "fsdp fake process group: all-gather of ", in.numel(),
               " elements into ", out.numel(), " at world size ", getSize());
    out.view({getSize(), in.numel()}).copy_(in.reshape({1, -1}));
    return c10::make_intrusive<DoneWork>();
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& /*opts*/) override {
    FSDP_CHECK(in.numel() == out.numel() * getSize(), "fsdp fake process group: reduce-scatter of ", in.numel(),
               " elements into ", out.numel(), " at world size ", getSize());
    out.copy_(in.view({getSize(), out.numel()})[getRank()]);
    return c10::make_intrusive<DoneWork>();
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& /*tensors*/,
                                           const c10d::AllreduceOptions& /*opts*/) override {
    return c10::make_intrusive<DoneWork>();
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& /*tensors*/,
                                           const c10d::BroadcastOptions& /*opts*/) override {
    return c10::make_intrusive<DoneWork>();
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& /*opts*/) override {
    return c10::make_intrusive<DoneWork>();
  }
};

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> make_fake_process_group(int rank, int world_size) {
  FSDP_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "fsdp::make_fake_process_group: rank ", rank,
             " is not in [0, ", world_size, ")");
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(c10::make_intrusive<c10d::HashStore>(), rank, world_size);
  auto backend = c10::make_intrusive<FakeBackend>(rank, world_size);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  return pg;
}

namespace detail {
bool is_fake_backend(const c10d::Backend& backend) {
  return dynamic_cast<const FakeBackend*>(&backend) != nullptr;
}
}  // namespace detail

}  // namespace fsdp
