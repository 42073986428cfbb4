// The flight recorder: every collective this process issues through the library (Comm), the last
// N of them, kept in a ring, and written to a file per rank when a collective fails or times out,
// or when the process receives $FSDP_DUMP_ON_SIGNAL. `fsdp-trace` reads the files of all ranks
// and names the rank that is behind and the collective it stopped at (docs/usage.md, "When a run
// hangs: the flight recorder"). PyTorch's NCCL flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE,
// torch.distributed.flight_recorder) is the model; this one records every backend's collectives
// and needs no NCCL. Internal to the library.
//
// Recording is a mutex and a slot of the ring (its strings reuse their capacity): no collective,
// no synchronization and no store traffic is added. The heartbeat publishes the last entry
// (fsdp/internal/monitor.cpp), so that a rank whose peer is stopped (and can dump nothing) still
// learns the peer's last collective from the store.
#pragma once

#include "fsdp/export.h"
#include "fsdp/internal/heartbeat_record.h"

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::detail {

struct PeerDiagnosis;

/// Where a recorded collective stands. A CUDA collective waited for on a stream (Comm::wait never
/// blocks the CPU there) stays kEnqueued: the CPU does not know when it ended.
enum class TraceState : uint8_t { kIssued, kCompleted, kEnqueued, kFailed, kTimedOut };
const char* trace_state_name(TraceState s);

/// A group as the recorder knows it: its name and members, and the number of collectives issued
/// on it so far. Ranks of one group issue the same collectives on it in the same order, so their
/// per-group numbers are comparable: the rank with the lowest is behind.
struct TraceGroup {
  std::string name;
  std::vector<int> global_ranks;
  int64_t issued = 0;       // guarded by the recorder's mutex
  bool background = false;  // not the heartbeat's last collective (GroupInfo::background)
};

/// The one TraceGroup of this name and these members (Comms of one group share its count).
FSDP_TESTING_API std::shared_ptr<TraceGroup> trace_group(const std::string& name, const std::vector<int>& global_ranks,
                                                         bool background = false);

struct TraceEntry {
  int64_t seq = -1;  ///< process-wide, from 0
  std::shared_ptr<TraceGroup> group;
  int64_t group_seq = -1;  ///< within the group, from 0
  const char* op = "";     ///< "all-gather", "reduce-scatter", "all-reduce", "broadcast", "agreement", ...
  std::string what;        ///< the collective's description: operation and unit
  int64_t numel = 0;       ///< of this rank's input tensor
  int64_t bytes = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  int64_t issued_ms = 0;  ///< unix ms
  int64_t ended_ms = 0;   ///< unix ms when it completed, failed, timed out or was enqueued; 0: not yet
  TraceState state = TraceState::kIssued;
};

/// Reads $FSDP_FLIGHT_RECORDER_SIZE and $FSDP_DUMP_ON_SIGNAL (once per process; a malformed value
/// throws fsdp::Error naming the variable, every time this is called). Called by
/// fsdp::init_process_group and by every Comm.
void init_flight_recorder();

/// This process's rank and the job's size, for the dump's name and contents (set by every Comm;
/// rank -1 until then).
void set_trace_identity(int global_rank, int world_size);
void trace_identity(int& global_rank, int& world_size);

/// Records a collective as issued on `group` and returns its number (for trace_end), or -1 when
/// the recorder is off. `numel`, `dtype`, `device`: this rank's input tensor.
FSDP_TESTING_API int64_t trace_issue(const std::shared_ptr<TraceGroup>& group, const char* op, const std::string& what,
                                     int64_t numel, int64_t bytes, c10::ScalarType dtype, c10::Device device);
/// Records how collective `seq` ended (nothing when it left the ring, or seq < 0).
FSDP_TESTING_API void trace_end(int64_t seq, TraceState state);

/// The last entry of a group that is not a background one, as the heartbeat publishes it.
FSDP_TESTING_API LastCollective last_collective();

/// The ring, oldest first; the ring's size; how many collectives were recorded in all.
FSDP_TESTING_API std::vector<TraceEntry> trace_entries();
FSDP_TESTING_API size_t trace_capacity();
FSDP_TESTING_API int64_t trace_recorded();

/// The directory of the dumps ($FSDP_FLIGHT_RECORDER_DIR, else /tmp/fsdp-trace) and this rank's
/// file in it ("fsdp-trace-rank-<global rank>.json").
std::string trace_dir();
FSDP_TESTING_API std::string trace_file(int global_rank);

struct DumpResult {
  std::string path;   ///< the file written, "" when none
  std::string error;  ///< why none was written ("" when the recorder is off or it was written)
};
/// Writes this rank's dump: `reason` ("timeout in <what>", "signal SIGUSR1"), the entries, and
/// the peers' heartbeats as `peers` read them (with the diagnosis text, when a failure caused it).
/// Never throws: a failure is returned in `error`.
FSDP_TESTING_API DumpResult dump_flight_record(const std::string& reason, const PeerDiagnosis& peers);

/// Testing: empties the ring and sets its size (as $FSDP_FLIGHT_RECORDER_SIZE would).
FSDP_TESTING_API void reset_flight_recorder_for_testing(size_t capacity);

}  // namespace fsdp::detail
