#include "fsdp/process_group.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/env.h"
#include "fsdp/internal/subgroups.h"

#include "fsdp/env.h"
#include "fsdp/fake_process_group.h"
#include "fsdp/internal/comm.h"
#include "fsdp/internal/cuda_backend.h"
#include "fsdp/internal/flight_recorder.h"
#include "fsdp/internal/launcher.h"
#include "fsdp/internal/monitor.h"
#include "fsdp/internal/nccl_device.h"
#include "fsdp/internal/race_delay.h"
#include "fsdp/internal/rendezvous.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <cstdlib>
#include <limits>

namespace fsdp {
namespace {

using detail::getenv_or_null;

int parse_int(const char* name, const char* value, int lo, int hi) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(value, &end, 10);
  FSDP_CHECK(errno == 0 && end != value && *end == '\0' && v >= lo && v <= hi,
             "fsdp::init_process_group: environment variable ", name, "='", value, "' is not an integer in [", lo, ", ",
             hi, "]. Launch with torchrun or srun, or fix the variable.");
  return static_cast<int>(v);
}

int require_int(const char* name, const char* launcher, int lo, int hi) {
  const char* v = getenv_or_null(name);
  FSDP_CHECK(v != nullptr, "fsdp::init_process_group: environment variable ", name, " is not set, but the ", launcher,
             " environment is partly there. Launch with `torchrun --no-python --nproc-per-node N ./program` "
             "(or srun under Slurm), or unset the launcher variables to run a single process.");
  return parse_int(name, v, lo, hi);
}

LaunchEnv& current_env() {
  static LaunchEnv env;
  return env;
}

// Whether the last init_process_group gave this process a CUDA backend (NCCL, or Gloo in the
// testing mode): fsdp::cuda_device's answer then is the device it bound.
bool& cuda_backend_added() {
  static bool added = false;
  return added;
}

void read_master(LaunchEnv& env) {
  if (env.world_size == 1) return;
  const char* addr = getenv_or_null("MASTER_ADDR");
  FSDP_CHECK(
      addr != nullptr, "fsdp::init_process_group: environment variable MASTER_ADDR is not set (rank ", env.rank, " of ",
      env.world_size,
      env.launcher == "torchrun" ? ", from RANK and WORLD_SIZE as torchrun sets them" : ", launcher " + env.launcher,
      "). ",
      env.launcher == "slurm"
          ? "Under Slurm, export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)."
          : "torchrun sets it; set it to rank 0's host when launching by hand.");
  env.master_addr = addr;
  const char* port = getenv_or_null("MASTER_PORT");
  if (port == nullptr) {
    FSDP_CHECK(env.launcher == "slurm", "fsdp::init_process_group: environment variable MASTER_PORT is not set (rank ",
               env.rank, " of ", env.world_size, "). torchrun sets it; set it to a free port when launching by hand.");
    env.master_port = 29500;
  } else {
    env.master_port = parse_int("MASTER_PORT", port, 1, 65535);
  }
}

}  // namespace

LaunchEnv read_launch_env() {
  constexpr int kMax = std::numeric_limits<int>::max();
  LaunchEnv env;
  const bool torchrun = getenv_or_null("RANK") || getenv_or_null("WORLD_SIZE") || getenv_or_null("LOCAL_RANK");
  if (torchrun) {
    env.launcher = "torchrun";
    env.world_size = require_int("WORLD_SIZE", "torchrun", 1, kMax);
    env.rank = require_int("RANK", "torchrun", 0, kMax);
    const char* lr = getenv_or_null("LOCAL_RANK");
    env.local_rank = lr ? parse_int("LOCAL_RANK", lr, 0, kMax) : env.rank;
    const char* agent = getenv_or_null("TORCHELASTIC_USE_AGENT_STORE");
    env.agent_store = agent != nullptr && std::string(agent) == "True";
  } else if (getenv_or_null("SLURM_PROCID")) {
    env.launcher = "slurm";
    env.world_size = require_int("SLURM_NTASKS", "Slurm", 1, kMax);
    env.rank = require_int("SLURM_PROCID", "Slurm", 0, kMax);
    const char* lr = getenv_or_null("SLURM_LOCALID");
    env.local_rank = lr ? parse_int("SLURM_LOCALID", lr, 0, kMax) : 0;
  } else {
    env.launcher = "none";
    return env;
  }
  FSDP_CHECK(env.rank < env.world_size, "fsdp::init_process_group: inconsistent ", env.launcher, " environment: rank ",
             env.rank, " is not below the world size ", env.world_size, " (",
             env.launcher == "slurm" ? "SLURM_PROCID / SLURM_NTASKS" : "RANK / WORLD_SIZE", ").");
  read_master(env);
  return env;
}

LaunchEnv make_launch_env(int rank, int world_size, bool need_master) {
  FSDP_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "fsdp::init_process_group: rank ", rank,
             " and world size ", world_size, " given in InitOptions are inconsistent: need 0 <= rank < world_size.");
  LaunchEnv env;
  env.launcher = "explicit";
  env.rank = rank;
  env.world_size = world_size;
  env.local_rank = rank;
  if (need_master) read_master(env);
  return env;
}

const LaunchEnv& launch_env() {
  return current_env();
}

c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const InitOptions& options) {
  const std::string& method = options.init_method();
  const bool file_store = method.rfind("file://", 0) == 0;
  FSDP_CHECK(file_store || method == "env://", "fsdp::init_process_group: unknown init_method '", method,
             "'; use \"env://\" or \"file:///path\".");
  FSDP_CHECK((options.rank() < 0) == (options.world_size() < 0),
             "fsdp::init_process_group: give both InitOptions::rank and InitOptions::world_size, or neither.");
  const std::chrono::milliseconds timeout = options.timeout();
  FSDP_CHECK(timeout.count() > 0, "fsdp::init_process_group: InitOptions::timeout must be positive, not ",
             timeout.count(), " ms.");
  detail::init_flight_recorder();  // FSDP_FLIGHT_RECORDER_SIZE, FSDP_DUMP_ON_SIGNAL: refused before any rendezvous
  LaunchEnv env =
      options.rank() >= 0 ? make_launch_env(options.rank(), options.world_size(), !file_store) : read_launch_env();
  detail::set_trace_identity(env.rank, env.world_size);
  // FSDP_TEST_GLOO_CUDA=1 (docs/usage.md, "Several ranks on one GPU"): refused at once without a GPU.
  // The variables of the GPU testing mode and of the race switch, refused here with this rank's
  // place before any rendezvous (the switch is read again by every model: it is read once).
  const ErrorContext in = ErrorContext().api("fsdp::init_process_group").rank(env.rank).world_size(env.world_size);
  bool gloo_cuda = false;
  try {
    gloo_cuda = detail::gloo_cuda_from_env();
    detail::race_delay_seed();
  } catch (const Error& e) {
    std::string what = e.what_without_backtrace();
    if (what.rfind("fsdp: ", 0) == 0) what = what.substr(6);
    FSDP_CHECK_IN(in, false, what);
  }
  FSDP_CHECK_IN(in, !gloo_cuda || detail::cuda_device_count() > 0,
                "FSDP_TEST_GLOO_CUDA=1 asks for the testing mode of several ranks on one GPU over Gloo, but this "
                "machine shows no CUDA device (or this LibTorch has no CUDA); unset FSDP_TEST_GLOO_CUDA to train on "
                "the CPU.");
  detail::arm_parent_death_signal(env);
  detail::Rendezvous r = detail::rendezvous(env, options, timeout);
  detail::explain_gloo_aborts(env.rank);

  // The attempt's store: new_subgroup() and NCCL's unique-id exchange key off pg->getStore().
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(r.scoped, env.rank, env.world_size);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, r.gloo);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  if (gloo_cuda) {
    // The testing mode: every local rank on cuda:0, the one Gloo backend serving CUDA tensors too
    // (its collectives stage them through pinned host memory; Comm completes them through wait()).
    detail::set_cuda_device(0);
    pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, r.gloo);
    detail::nccl_absent_reason().clear();
    cuda_backend_added() = true;
  } else {
    cuda_backend_added() = options.nccl() && detail::maybe_add_nccl_backend(*pg, r.scoped, env, timeout);
  }
  if (env.world_size > 1) {
    // The heartbeat gets a connection of its own: it must not wait behind (or hold up) this one.
    c10::intrusive_ptr<c10d::Store> beat_store;
    try {
      beat_store = r.store->clone();
      beat_store->setTimeout(std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(5)));
    } catch (const std::exception&) {
      beat_store = r.store;
    }
    detail::start_heartbeat(beat_store, r.prefix, env.rank);
  }
  current_env() = env;
  return pg;
}

c10::Device cuda_device() {
  const LaunchEnv& env = current_env();
  const ErrorContext in = ErrorContext().api("fsdp::cuda_device").rank(env.rank).world_size(env.world_size);
  FSDP_CHECK_IN(in, detail::cuda_device_count() > 0,
                "this machine shows no CUDA device (or this LibTorch has no CUDA): train on the CPU.");
  const std::string& why = detail::nccl_absent_reason();
  FSDP_CHECK_IN(in, why.empty(), why);
  FSDP_CHECK_IN(in, cuda_backend_added(),
                "fsdp::init_process_group gave this process no CUDA backend (it was not called yet, or with "
                "InitOptions::nccl(false)): call it first, with NCCL on, to train on a GPU.");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(detail::current_cuda_device()));
}

c10::intrusive_ptr<c10d::ProcessGroup> new_subgroup(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                    const std::vector<int>& ranks, const std::string& name) {
  FSDP_CHECK(pg, "fsdp::new_subgroup: the parent process group is null");
  const int me = pg->getRank();
  const ErrorContext in = ErrorContext().api("fsdp::new_subgroup").rank(me).world_size(pg->getSize());
  const auto it = std::find(ranks.begin(), ranks.end(), me);
  FSDP_CHECK_IN(in, it != ranks.end(), "this rank is not among the ranks of subgroup '", name, "'");
  // The members' global ranks (through the parent's when it is a subgroup too), for messages.
  const auto parent_info = detail::subgroup_info(pg.get());
  std::vector<int> global;
  for (const int r : ranks) {
    FSDP_CHECK_IN(in, r >= 0 && r < pg->getSize(), "rank ", r, " of subgroup '", name,
                  "' is not a rank of the parent group of ", pg->getSize());
    global.push_back(parent_info ? parent_info->global_ranks.at(static_cast<size_t>(r)) : r);
  }
  const int job = parent_info ? parent_info->world_size : pg->getSize();
  if (detail::is_fake_backend(*pg->getBackend(c10::DeviceType::CPU))) {  // a simulated job's subgroup
    auto fake = make_fake_process_group(static_cast<int>(it - ranks.begin()), static_cast<int>(ranks.size()));
    detail::remember_subgroup(fake, name, global, job);
    return fake;
  }
  auto store = pg->getStore();
  FSDP_CHECK_IN(in, store, "the parent process group has no store; create it with fsdp::init_process_group()");
  auto parent = c10::dynamic_intrusive_pointer_cast<c10d::ProcessGroupGloo>(pg->getBackend(c10::DeviceType::CPU));
  FSDP_CHECK_IN(in, parent, "the parent process group has no Gloo backend for CPU");
  const int rank = static_cast<int>(it - ranks.begin());
  const int size = static_cast<int>(ranks.size());
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("fsdp_subgroup/" + name, store);
  auto opts = c10d::ProcessGroupGloo::Options::create(parent->getOptions()->timeout);
  opts->devices = parent->getOptions()->devices;
  opts->threads = parent->getOptions()->threads;
  auto sub = c10::make_intrusive<c10d::ProcessGroup>(prefixed, rank, size);
  c10::intrusive_ptr<c10d::Backend> gloo;
  try {
    gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("gloo", prefixed), rank,
                                                       size, opts);
  } catch (const std::exception& e) {
    FSDP_CHECK(false, "fsdp::new_subgroup: rank ", me, " could not connect subgroup '", name, "' within ",
               opts->timeout.count(), " ms: ", error_text(e), " Every member must create it with the same ranks.");
  }
  sub->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  sub->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  bool parent_has_cuda = false;
  for (const auto& d : pg->getDeviceTypes()) parent_has_cuda = parent_has_cuda || d.is_cuda();
  if (parent_has_cuda && pg->getBackend(c10::DeviceType::CUDA)->getBackendName() == "gloo") {
    sub->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, gloo);  // the testing mode
  } else if (parent_has_cuda) {
    LaunchEnv env = current_env();
    env.rank = rank;
    env.world_size = size;
    detail::maybe_add_nccl_backend(*sub, prefixed, env, opts->timeout);
  }
  detail::remember_subgroup(sub, name, global, job);
  return sub;
}

void all_reduce(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, at::Tensor& tensor, c10d::ReduceOp op) {
  FSDP_CHECK(pg, "fsdp::all_reduce: the process group is null");
  if (pg->getSize() == 1) return;
  detail::Comm comm(pg, detail::group_timeout(*pg));
  const std::string what = "fsdp::all_reduce of " + std::to_string(tensor.numel()) + " " +
                           std::string(c10::toString(tensor.scalar_type())) + " element(s)";
  // Every rank must be at this call: one rank reducing a metric while another runs the model would
  // otherwise pair collectives of different sizes.
  comm.agree(detail::Call::kUserAllReduce, detail::Comm::reduction_fingerprint(tensor, op, what), what);
  comm.all_reduce(tensor, std::move(op), what);
}

}  // namespace fsdp
