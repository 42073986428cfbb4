// Start-up of a job: reach the store, check that this rank belongs to the job that owns it, wait
// for every rank, connect Gloo. Bounded by the timeout in every case (an address that does not
// resolve, a port where nothing listens, a port held by a service that never answers, a rank that
// never comes). Internal to the library.
#pragma once

#include "fsdp/process_group.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace fsdp::detail {

struct Rendezvous {
  c10::intrusive_ptr<c10d::Store> store;  ///< the job's store
  /// This attempt's part of it (`prefix` + "pg"): the process group's, Gloo's, NCCL's and the
  /// subgroups' keys. torchrun's agent keeps one store across restarts, so keys an earlier
  /// attempt wrote (Gloo's listening addresses) must not be where this attempt looks.
  c10::intrusive_ptr<c10d::Store> scoped;
  c10::intrusive_ptr<c10d::Backend> gloo;  ///< connected to every rank
  std::string prefix;                      ///< where this library keeps its keys in the store
};

/// Runs the start-up of rank `env.rank` within `timeout` (the deadline is measured from the call);
/// throws a message naming the address, the port, the stage and what was found there.
Rendezvous rendezvous(const LaunchEnv& env, const InitOptions& options, std::chrono::milliseconds timeout);

/// What answers at host:port within `budget`: a sentence for error messages (resolution failure,
/// connection refused, no answer, or a service that accepted the connection), and whether waiting
/// longer cannot help (a name that does not resolve, and not for a temporary reason).
struct Probe {
  std::string found;
  bool permanent = false;
  bool accepted = false;  ///< something listens and accepted the connection
  bool refused = false;   ///< nothing listens there (yet)
};
Probe probe_endpoint(const std::string& host, int port, std::chrono::milliseconds budget);

}  // namespace fsdp::detail
