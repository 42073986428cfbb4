#include "fsdp/internal/options_check.h"

#include "fsdp/internal/check.h"
#include "fsdp/internal/cuda_backend.h"
#include "fsdp/internal/env.h"
#include "fsdp/internal/subgroups.h"

#include <c10/util/Exception.h>

#include <string>

namespace fsdp {

namespace detail {
void check_options(const FullyShardOptions& o, const char* caller, const c10d::ProcessGroup& pg) {
  // Named by global rank, as every message is ("rank 3 of 4"), also when `pg` is a subgroup.
  const auto sub = subgroup_info(&pg);
  const int rank = sub ? sub->global_ranks.at(static_cast<size_t>(pg.getRank())) : pg.getRank();
  const ErrorContext context = ErrorContext().api(caller).operation(caller).rank(rank).world_size(
      sub && sub->world_size > 0 ? sub->world_size : pg.getSize());
  FSDP_CHECK_IN(context, is_valid(o.strategy()), "FullyShardOptions::strategy is ", static_cast<int>(o.strategy()),
                ", not a ShardingStrategy; use one of fsdp::ShardingStrategy's values (fsdp/strategy.h).");
  FSDP_CHECK_IN(context, o.prefetch() >= 0, "FullyShardOptions::prefetch is ", o.prefetch(),
                "; it is the number of units gathered ahead, 0 or more (0 turns prefetch off).");
  FSDP_CHECK_IN(context, o.bucket_bytes() > 0, "FullyShardOptions::bucket_bytes is ", o.bucket_bytes(),
                "; replicated units all-reduce their gradients in buckets of that many bytes, so it must be "
                "positive (PyTorch DDP's default is 25 MiB).");
  FSDP_CHECK_IN(context, o.activation_checkpointing_every() >= 0,
                "FullyShardOptions::activation_checkpointing_every is ", o.activation_checkpointing_every(),
                "; it checkpoints every k-th unit, so it is 0 (none) or more (1: every unit).");
  FSDP_CHECK_IN(context, o.timeout().count() > 0, "FullyShardOptions::timeout is ", o.timeout().count(),
                " ms; it bounds every wait for a collective, so it must be positive (the default is 10 minutes).");
  if (const auto& d = o.device()) {
    FSDP_CHECK_IN(context, d->is_cpu() || d->is_cuda(), "FullyShardOptions::device is ", *d,
                  "; the library trains on the CPU or on a CUDA device. Pass torch::kCPU or fsdp::cuda_device().");
    const int gpus = d->is_cuda() ? cuda_device_count() : 0;
    FSDP_CHECK_IN(context, d->is_cpu() || (gpus > 0 && d->index() < gpus), "FullyShardOptions::device is ", *d,
                  ", but this process sees ", gpus, " CUDA device", gpus == 1 ? "" : "s",
                  gpus == 0 ? " (no GPU, or LibTorch built without CUDA)" : "",
                  gpus == 0
                      ? ". On a machine without a GPU leave the option unset (or pass torch::kCPU)."
                      : ". Pass fsdp::cuda_device() (this rank's GPU), or leave the option unset to keep the model "
                        "where it was built.");
  }
}
bool offload_on_cpu_for_tests() {
  const char* v = getenv_or_null("FSDP_TEST_OFFLOAD_ON_CPU");
  return v != nullptr && std::string(v) == "1";
}

void check_offload(const FullyShardOptions& o, const std::string& param, const c10::Device& device,
                   const ErrorContext& where) {
  if (!o.offload_policy()) return;
  if (device.is_cpu() && offload_on_cpu_for_tests()) return;
  FSDP_CHECK_IN(where, device.is_cuda(),
                "FullyShardOptions::offload_policy keeps a CUDA model's shards, gradients and optimizer state in "
                "host memory, but this model's parameters are on ",
                device, " ('", param,
                "'): there is nothing to offload, they are in host memory already. Remove offload_policy, or build "
                "the model on a CUDA device before fsdp::fully_shard (model->to(fsdp::cuda_device()), or "
                "FullyShardOptions::device, which a ShardingScope applies to each unit as it is built).");
}

}  // namespace detail

}  // namespace fsdp
