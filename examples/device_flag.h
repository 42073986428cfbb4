// --device cpu|cuda, the examples' one way to choose where they train: the flag, its refusal on a
// machine without CUDA (before any process group, so that a bad flag fails alone and at once), and
// the device itself once the process group exists: the GPU the library bound this rank to
// (fsdp::cuda_device: cuda:LOCAL_RANK under NCCL, cuda:0 in the Gloo testing mode).
#pragma once

#include "fsdp/process_group.h"
#include "programs/flags.h"

#include <torch/cuda.h>
#include <torch/types.h>

#include <string>

namespace examples {

inline void add_device_flag(fsdp::programs::Flags& flags, std::string& device) {
  flags.choice("--device", device, {"cpu", "cuda"}, "where the model trains (cuda: this rank's GPU)");
}

/// --device cuda on a machine without a CUDA device: a usage error (exit 2), before anything runs.
inline void check_device_flag(const std::string& device) {
  if (device == "cuda" && !torch::cuda::is_available()) {
    throw fsdp::programs::UsageError(
        "--device cuda, but this machine has no CUDA device (or LibTorch was built without CUDA); train with --device "
        "cpu",
        false);
  }
}

/// After fsdp::init_process_group: the CPU, or this rank's GPU.
inline torch::Device training_device(const std::string& device) {
  return device == "cuda" ? fsdp::cuda_device() : torch::Device(torch::kCPU);
}

/// Waits for the GPU's queued work (a step's time, measured on the CPU, then includes it).
inline void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

}  // namespace examples
