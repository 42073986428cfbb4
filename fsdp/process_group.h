// Process groups from a launcher's environment: torchrun, Slurm, or none (one process).
#pragma once

#include "fsdp/env.h"
#include "fsdp/export.h"

#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp {

/// Where this process sits in the job, as its launcher described it.
struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;  ///< empty for a single process
  int master_port = 0;
  std::string launcher;      ///< "torchrun", "slurm" or "none"
  bool agent_store = false;  ///< torchrun's agent already hosts the TCPStore: every rank joins as a client
};

/// Reads the launcher's environment. torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
/// MASTER_PORT. Slurm (when RANK is unset): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, plus
/// MASTER_ADDR (MASTER_PORT defaults to 29500). Neither: a single process. Missing or inconsistent
/// variables throw a c10::Error naming the variable.
LaunchEnv read_launch_env();
/// The same with the rank and world size given, reading only MASTER_ADDR / MASTER_PORT (when
/// `need_master` and world_size > 1).
LaunchEnv make_launch_env(int rank, int world_size, bool need_master);

struct InitOptions {
  /// Bound on the start-up (reaching the store, every rank joining, connecting Gloo) and on every
  /// collective of the group. Precedence: this option when set, else $FSDP_TIMEOUT (seconds), else
  /// 10 minutes (as c10d and NCCL).
  InitOptions& timeout(std::chrono::milliseconds t) {
    timeout_ = t;
    return *this;
  }
  std::chrono::milliseconds timeout() const { return timeout_ ? *timeout_ : default_timeout(); }
  /// "env://" (torchrun, Slurm or a single process) or "file:///path" (a FileStore; the rank and
  /// world size then come from the environment as well).
  TORCH_ARG(std::string, init_method) = "env://";
  /// Network interface for Gloo ("lo", "eth0"); empty: $GLOO_SOCKET_IFNAME, else this host's address.
  TORCH_ARG(std::string, gloo_interface) = "";
  /// Explicit rank and world size (both, or neither): then the launcher's variables are not read
  /// for them (with "env://", MASTER_ADDR and MASTER_PORT still are).
  TORCH_ARG(int, rank) = -1;
  TORCH_ARG(int, world_size) = -1;
  /// Also create an NCCL backend for CUDA tensors when this LibTorch has CUDA and a GPU is present.
  TORCH_ARG(bool, nccl) = true;

 private:
  std::optional<std::chrono::milliseconds> timeout_;
};

/// Creates the process group of this job: Gloo for CPU tensors and (where available) NCCL for CUDA
/// tensors, after a TCPStore rendezvous. World size 1 needs no launcher and no environment.
///
/// Start-up ends within the timeout in every case, with an error naming the store's address and
/// port and what was found there (a name that does not resolve, nothing listening, a service that
/// does not answer as a store, ranks that never joined). Each rank claims its rank in the store
/// once, under the job's identity (FSDP_JOB_ID, torchrun's run id or Slurm's job id): a process of
/// another job that reaches this job's store is told so. Under torchrun, this process also gets
/// SIGTERM if torchrun dies (FSDP_PARENT_DEATH_SIGNAL, fsdp/env.h). A heartbeat thread then
/// publishes this rank's state in the store every second, so that a failed collective can name the
/// peer that stopped answering.
c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const InitOptions& options = {});

/// A process group of `ranks` (ranks of `pg`, this rank among them, in the order that defines the
/// new ranks) with the same backends and options as `pg`, rendezvousing through `pg`'s store
/// under `name`. Only the members take part, and all of them must call it with the same `ranks`
/// and `name`; a name must be new for the store. The library's errors over it (a model wrapped
/// over it, a DeviceMesh over it) name its members by their global ranks in the job.
c10::intrusive_ptr<c10d::ProcessGroup> new_subgroup(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                    const std::vector<int>& ranks, const std::string& name);

/// The LaunchEnv the last init_process_group() used (single process before any call).
const LaunchEnv& launch_env();

/// The GPU this process trains on, as init_process_group() bound it: cuda:LOCAL_RANK with NCCL,
/// cuda:0 in the Gloo testing mode (FSDP_TEST_GLOO_CUDA=1, docs/usage.md). Build the model there
/// (`model->to(fsdp::cuda_device())`) before wrapping it. Throws fsdp::Error saying why where this
/// process has none: no CUDA device, or a local rank past the host's GPUs.
c10::Device cuda_device();

/// Reduces `tensor` in place over all ranks of `pg` (like torch.distributed.all_reduce), waiting at
/// most the timeout init_process_group was given. For metrics in training loops (losses, bytes).
void all_reduce(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, at::Tensor& tensor,
                c10d::ReduceOp op = c10d::ReduceOp::SUM);

}  // namespace fsdp

FSDP_PUBLIC_END
