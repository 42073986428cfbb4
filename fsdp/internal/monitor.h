// What this process tells its peers about itself, and what it can find out about them when a
// collective fails. Internal to the library.
//
// - A heartbeat: a background thread writes this rank's state into the job's store every second
//   (a counter, the time, host and pid, and what it is doing: "idle", "in <collective> since ...").
//   When a collective fails, the rank reads its peers' heartbeats: a peer whose heartbeat stopped is
//   named as the one that died, was stopped or hangs, with what it was last doing. A peer whose
//   heartbeat goes on is alive (perhaps stuck elsewhere, or failed too).
// - Failed backends: a backend whose collective failed may still have its worker threads inside
//   that collective, and destroying it joins them (for up to the backend's own timeout). It is
//   kept alive until the process exits instead, so that the error path and tearing down the
//   process group return at once.
#pragma once

#include "fsdp/export.h"
#include "fsdp/internal/heartbeat_record.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace fsdp::detail {

/// "host:pid" of this process, as the heartbeat and the rank claims name it.
std::string host_and_pid();

/// Wall-clock milliseconds since the epoch: the time heartbeats and the flight recorder carry
/// (comparable between hosts, unlike a steady clock).
int64_t unix_ms();

/// Starts (or restarts, for a new process group) this process's heartbeat as global rank `rank`,
/// under `prefix` in `store`. `store` must be a connection of its own (a clone): the heartbeat
/// thread blocks in it when the store does not answer.
void start_heartbeat(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix, int rank);

/// While alive, this process's heartbeat says it is inside `what` (a collective being waited for).
class Activity {
 public:
  explicit Activity(const std::string& what);
  ~Activity();
  Activity(const Activity&) = delete;
  Activity& operator=(const Activity&) = delete;
};

/// Records that this rank failed in `what` (published with the next heartbeats).
void note_failure(const std::string& what);

/// What a failed collective's rank found out about its peers.
struct PeerDiagnosis {
  std::string text;                ///< a sentence, or "" when nothing is known
  int peer = -1;                   ///< the global rank that most likely caused it (stopped answering first), or -1
  std::map<int, Heartbeat> beats;  ///< the peers' heartbeats as last read (for the flight recorder's dump)
  std::set<int> stale;             ///< the peers found not running (stopped, killed, exited)
  int64_t read_at_ms = 0;          ///< unix ms of that read (0: none)
};

/// After a collective failed: a sentence about the peers among `global_ranks` (not this rank) —
/// which stopped answering and what they were last doing — or nothing when nothing is known (no
/// heartbeat in this process: a single rank, a process group not made by fsdp::init_process_group).
/// Takes at most about 3 seconds.
PeerDiagnosis diagnose_peers(const std::vector<int>& global_ranks, int self);

/// The peers' heartbeats as they are now, without a diagnosis (`text` empty unless the store does
/// not answer): for a flight-recorder dump that no failure caused. At most about 3 seconds.
PeerDiagnosis peer_states(const std::vector<int>& global_ranks, int self);

/// Installs (once) a std::terminate handler that, when Gloo's transport thread aborts the process
/// on a collective of mismatched size (an exception thrown where nothing can catch it), first
/// prints what happened and what to do, then calls the previous handler.
FSDP_TESTING_API void explain_gloo_aborts(int rank);

/// Keeps `backend` alive until the process exits (see above). Safe to call more than once.
void abandon_backend(const c10::intrusive_ptr<c10d::Backend>& backend);

}  // namespace fsdp::detail
