// Which GPU a rank's NCCL backend binds to, and why a rank has none. NCCL cannot run two ranks of
// one communicator on one GPU: it refuses with "Duplicate GPU detected", deep inside the first
// CUDA collective. So at start-up each rank takes its GPU by the GPU's identity on its host (its
// PCI bus id) through the job's store, and a rank whose GPU another rank of the group already took
// (more ranks on a host than GPUs, or ranks mapped to one device) gets no NCCL backend: its first
// CUDA collective says why and what to do (Comm::backend) instead of NCCL. CPU tensors are
// unaffected: Gloo serves them on every rank, so a CPU job may still start more ranks than the
// host has GPUs. Internal to the library.
#pragma once

#include "fsdp/export.h"
#include "fsdp/process_group.h"

#include <cstdint>
#include <string>

namespace fsdp::detail {

/// The device index local rank `env.local_rank` binds to among the `device_count` this process
/// sees: local_rank % device_count, as PyTorch's launch examples do (with one visible device per
/// rank, as Slurm's --gpus-per-task=1 gives, each rank's own).
FSDP_TESTING_API int nccl_device_index(const LaunchEnv& env, int device_count);

/// Why this rank may not bind NCCL to device `device` (PCI bus id `gpu`) of host `host`: `holders`
/// ranks of the group have taken that GPU so far, this one included ("" when it is the only one).
FSDP_TESTING_API std::string nccl_shared_gpu_refusal(const LaunchEnv& env, const std::string& host,
                                                     const std::string& gpu, int device, int device_count,
                                                     int64_t holders);

/// The reason this process was given no NCCL backend at start-up ("" when it has one, or none was
/// wanted), for the error of its first CUDA collective. Set by maybe_add_nccl_backend
/// (fsdp/internal/cuda_backend.h) each time fsdp::init_process_group or new_subgroup adds one.
FSDP_TESTING_API std::string& nccl_absent_reason();

}  // namespace fsdp::detail
