#include "fsdp/internal/gather.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/split_with_sizes_copy.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace fsdp::detail {

void pack_rows(const std::vector<ParamSlot>& slots, const at::Tensor& in) {
  in.zero_();
  for (const auto& s : slots) in.narrow(0, s.offset, s.sharded.numel()).copy_(s.sharded.reshape({-1}));
}

void copy_out(const at::Tensor& gathered, const at::Tensor& unsharded, const std::vector<ParamSlot>& slots, int64_t W,
              int64_t shard_numel) {
  std::vector<int64_t> sizes;
  std::vector<at::Tensor> outs;
  for (const auto& s : slots) {
    sizes.push_back(s.padded_numel());
    outs.push_back(unsharded.narrow(0, W * s.offset, W * s.padded_numel()).view({W, s.padded_numel()}));
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  at::split_with_sizes_copy_out(outs, gathered.view({W, shard_numel}), sizes, 1);
}

void gather_full(const std::vector<ParamSlot>& slots, const UnitBuffers& buffers, bool rows_of_full, int64_t S,
                 Comm& comm, const std::string& what, const at::Device& device, std::vector<at::Tensor>& out) {
  at::NoGradGuard no_grad;
  auto copy_to_device = [&](const at::Tensor& t) {
    out.push_back(t.to(device, t.scalar_type(), false, /*copy=*/true));
  };
  if (buffers.shard_numel == 0 || S == 1) {  // nothing to gather: the shard is the whole parameter
    for (const auto& s : slots) copy_to_device(s.sharded.reshape(s.shape));
    return;
  }
  at::Tensor in = buffers.flat_shard;
  if (rows_of_full) {
    in = at::empty({buffers.shard_numel}, buffers.unsharded.options());
    pack_rows(slots, in);
  }
  at::Tensor gathered = at::empty({S * buffers.shard_numel}, in.options());
  Pending p = comm.all_gather_async(gathered, in, what);
  comm.wait(p);
  const at::Tensor rank_major = gathered.view({S, buffers.shard_numel});
  for (const auto& s : slots) {
    copy_to_device(
        rank_major.narrow(1, s.offset, s.padded_numel()).reshape({-1}).narrow(0, 0, s.layout.numel()).view(s.shape));
  }
}

}  // namespace fsdp::detail
