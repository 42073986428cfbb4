#include "fsdp/internal/nccl_device.h"

#include <c10/util/StringUtil.h>

namespace fsdp::detail {

int nccl_device_index(const LaunchEnv& env, int device_count) {
  return device_count > 0 ? env.local_rank % device_count : 0;
}

std::string nccl_shared_gpu_refusal(const LaunchEnv& env, const std::string& host, const std::string& gpu, int device,
                                    int device_count, int64_t holders) {
  if (holders <= 1) return {};
  return c10::str("global rank ", env.rank, " of ", env.world_size, " (local rank ", env.local_rank,
                  ") would share its GPU, cuda:", device, " (PCI ", gpu, ") of host '", host, "', with ", holders - 1,
                  " other rank(s) of this group: NCCL cannot run two ranks on one GPU (it refuses with \"Duplicate "
                  "GPU detected\"), so this rank was given no NCCL backend. This process sees ",
                  device_count,
                  " CUDA device(s) (CUDA_VISIBLE_DEVICES decides which): to train on GPUs, start at most one rank per "
                  "GPU on each host (torchrun --nproc-per-node ",
                  device_count,
                  "), or give each rank a GPU of its own; CPU tensors need no GPU (Gloo serves them on every rank). "
                  "To test several ranks on one GPU, FSDP_TEST_GLOO_CUDA=1 runs them all on cuda:0 over Gloo, a "
                  "testing mode (docs/usage.md, 'Several ranks on one GPU').");
}

std::string& nccl_absent_reason() {
  static std::string reason;
  return reason;
}

}  // namespace fsdp::detail
