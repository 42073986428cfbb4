// FSDP_RACE_DELAY=SEED: seeded delays on both sides of the collectives, so that a wait the library
// forgot (compute reading a gather that has not landed, a buffer reused before the collective that
// reads it finished) shows as different numbers instead of passing by luck. With the switch on
// every result stays bit-identical to the run without it; the delays change when things happen,
// never what is computed. Unset or 0: off, and nothing here runs. docs/design.md, "Races made
// visible", says where each delay goes and why none is on the caller's side of a wait.
#pragma once

#include "fsdp/export.h"

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace fsdp::detail {

/// The seed in force: $FSDP_RACE_DELAY (read once; a value that is not a whole number is an error
/// naming the variable), or the last set_race_delay_for_testing. 0: off.
uint64_t race_delay_seed();
/// Parses a seed: a whole number of at most 18 digits, 0 for off; `what` names the variable.
FSDP_TESTING_API uint64_t parse_race_delay(const std::string& value, const std::string& what);
/// Tests: the seed from now on, as if $FSDP_RACE_DELAY were it (0: off). Returns the one before.
FSDP_TESTING_API uint64_t set_race_delay_for_testing(uint64_t seed);
/// The delays applied so far in this process. When the switch was on at any point, the process
/// prints "fsdp: race delays applied: N ..." to stderr at exit.
FSDP_TESTING_API int64_t race_delays_applied();

/// Where a delay goes. kIssue: the CPU, before it issues a collective (the ranks arrive at
/// different times; before the issue, so it never hides a race between issue and wait). kComm:
/// the communication side (the CPU backend's worker, the GPU's comm stream). kCompute: the GPU's
/// compute stream before the first use of a gathered buffer.
enum class RaceSide { kIssue = 0, kComm = 1, kCompute = 2 };
/// The next delay of `side` on global rank `rank`, drawn from the seed and counted as applied:
/// kIssue 0 to 1 ms, kComm and kCompute 0.1 to 2 ms. Zero when the switch is off.
std::chrono::microseconds next_race_delay(RaceSide side, int rank);

/// The CPU backend of the race switch over `inner` (one per backend in the process, made at the
/// first call and shared while alive): each collective runs on the wrapper's own worker thread (in
/// issue order, so the ranks still pair them up): after a delay it snapshots the inputs, runs
/// `inner`'s collective on staging buffers, waits for it (at most the collective's timeout), and
/// after a second delay copies the result into the caller's output; only then is the returned work
/// complete. A caller that reads the output or writes the input before its wait() therefore sees
/// different numbers. The all-gather, reduce-scatter, all-reduce and broadcast the library issues.
c10::intrusive_ptr<c10d::Backend> race_delay_backend(const c10::intrusive_ptr<c10d::Backend>& inner, int rank);

/// Tests: runs `fn` with a new stream of CUDA `device` current (from the pool), so that the GPU
/// race tests compute off the default stream, which Gloo's worker thread makes wait for each CUDA
/// collective it completes (a wait the library did not ask for, that could hide a missing one).
/// On a CPU device, runs `fn`.
FSDP_TESTING_API void on_pool_stream_for_testing(const c10::Device& device, const std::function<void()>& fn);

/// Tests only: a unit copies out its all-gather's output before waiting for the all-gather, the
/// missing wait the race switch must reveal (Unit::gather). Off unless a test turns it on.
FSDP_TESTING_API void read_gathers_before_wait_for_testing(bool on);
bool reads_gathers_before_wait();

}  // namespace fsdp::detail
