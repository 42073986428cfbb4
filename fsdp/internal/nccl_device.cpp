#include "fsdp/internal/nccl_device.h"

#include <c10/util/StringUtil.h>

namespace fsdp::detail {

std::string nccl_device_refusal(const LaunchEnv& env, int device_count) {
  // Ranks given in InitOptions have no known place on their host (local_rank is the global rank):
  // they keep the device local_rank % device_count.
  if (device_count <= 0 || env.local_rank < device_count || env.launcher == "explicit") return {};
  return c10::str("local rank ", env.local_rank, " (global rank ", env.rank, " of ", env.world_size,
                  ") has no GPU of its own: this host shows ", device_count,
                  " CUDA device(s) (CUDA_VISIBLE_DEVICES decides which), and NCCL cannot run two ranks on one GPU "
                  "(it refuses with \"Duplicate GPU detected\"), so this rank was given no NCCL backend. To train on "
                  "GPUs, start at most ",
                  device_count, " rank(s) per host (torchrun --nproc-per-node ", device_count,
                  "); CPU tensors need no GPU (Gloo serves them on every rank). To test several ranks on one GPU, "
                  "FSDP_TEST_GLOO_CUDA=1 runs them all on cuda:0 over Gloo, a testing mode (docs/usage.md, "
                  "'Several ranks on one GPU').");
}

std::string& nccl_absent_reason() {
  static std::string reason;
  return reason;
}

}  // namespace fsdp::detail
