// Multi-process test harness: a test body runs in N real processes over Gloo on loopback.
//
//   TEST(Suite, Name) {
//     fsdp::testing::run_ranks(3, [](fsdp::testing::Rank& r) { ... r.pg ... });
//   }
//
// The test process re-executes its own binary once per rank (never fork: torch has threads),
// filtered to the same test, with the rank in the environment. Each rank is its own process group
// (killed as a whole on timeout); rendezvous goes through a FileStore in a fresh temporary
// directory, so tests run in parallel without port clashes. A rank that fails, crashes or hangs
// fails the test within the time limit, and every rank's output is printed (always, with
// FSDP_TEST_SHOW_OUTPUT=1 in the environment).
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace fsdp::testing {

struct Rank {
  int rank = 0;
  int world_size = 1;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
};

struct RunOptions {
  /// Whole-test limit; the ranks are killed after it.
  std::chrono::seconds timeout{120};
  /// Limit for each collective inside the ranks (process group and fully_shard).
  std::chrono::seconds collective_timeout{30};
  /// "file" (FileStore rendezvous) or "env" (torchrun-style variables and a TCPStore on a free port).
  std::string rendezvous = "file";
  /// Extra environment for the ranks.
  std::map<std::string, std::string> env;
  /// Create the process group before calling the body (false: the body does it itself).
  bool init_process_group = true;
  /// Give that group an NCCL backend for CUDA tensors (the Cuda.* tests, at world size 1: one GPU
  /// cannot host two NCCL ranks); otherwise Gloo alone, for CPU tensors.
  bool nccl = false;
  /// Ranks whose death (a signal or a non-zero exit) is what the test is about, not a failure; once
  /// every other rank has finished, those still running (stopped, hanging) are killed.
  std::vector<int> may_die;
};

/// Runs `body` once in each of `world_size` processes. A test may call it several times, one
/// launch after the other (save at N ranks, then load at M); the test body is re-run from its
/// start in each rank process, so what it does outside the bodies it does there too (pass what a
/// later launch needs through RunOptions::env or files, not through captured variables).
void run_ranks(int world_size, const std::function<void(Rank&)>& body, const RunOptions& options = {});

/// True inside a rank process.
bool in_rank_process();

/// A directory shared by the ranks of this test (files between them), removed after the test. The
/// ranks' flight-recorder files go to its subdirectory "flight-recorder" (FSDP_FLIGHT_RECORDER_DIR,
/// unless RunOptions::env sets it).
std::string shared_dir();

/// The per-collective timeout of this rank process (RunOptions::collective_timeout).
std::chrono::milliseconds collective_timeout();

/// Sum of `t` over ranks, in place (for losses in tests).
void all_reduce_sum(Rank& r, at::Tensor& t);

}  // namespace fsdp::testing
