// fsdp-trace's reading of the flight recorder's files (fsdp/internal/flight_recorder.h): every
// rank's dump, and which rank is behind in which group, at which collective. A library of its
// own so that the tests call what the tool runs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::trace {

/// One collective of a dump, or a peer's last one as its heartbeat said.
struct Collective {
  int64_t seq = -1;
  std::string group;
  std::vector<int> group_ranks;  ///< empty when known from a heartbeat only
  int64_t group_seq = -1;
  std::string op, what, state, dtype, device;
  int64_t numel = 0, bytes = 0, issued_unix_ms = 0, ended_unix_ms = 0;
};

/// A peer's heartbeat as the dumping rank read it.
struct PeerRecord {
  int rank = -1;
  std::string who;
  int64_t heartbeat_unix_ms = 0;
  bool stale = false, exited = false;
  std::string activity, failure;
  std::optional<Collective> last;
};

/// One rank's file.
struct Dump {
  std::string path;
  int rank = -1, world_size = 0;
  std::string host, reason, diagnosis;
  int64_t pid = 0, dump_unix_ms = 0, capacity = 0, recorded = 0, peers_read_unix_ms = 0;
  std::string job;  ///< the run that wrote it (torchrun's run id, store address, restart count)
  std::vector<Collective> entries;  ///< oldest first
  std::vector<PeerRecord> peers;
};

/// Reads one file; throws std::runtime_error naming the file and what is wrong with it.
Dump read_dump(const std::string& path);
/// The dumps named: a directory stands for its fsdp-trace-rank-*.json files. Throws
/// std::runtime_error when a file cannot be read or a directory holds none.
std::vector<Dump> read_dumps(const std::vector<std::string>& paths);

/// One rank's place in a group.
struct Member {
  int rank = -1;
  std::string source;              ///< "file" (its own dump), "heartbeat" (a peer's record of it), "none"
  std::optional<Collective> last;  ///< its last collective in this group
  int64_t heartbeat_unix_ms = 0;   ///< source "heartbeat": when that heartbeat was written
  std::string note;                ///< "stopped answering", "exited", ...
};

struct GroupReport {
  std::string name;
  std::vector<int> ranks;
  std::vector<Member> members;
  std::vector<int> behind;               ///< the ranks at the lowest position (or unknown), when not all equal
  std::optional<Collective> waiting_in;  ///< the collective the others wait in (not completed), if any
  std::vector<int> waiting;              ///< the ranks waiting in it
  std::string verdict;                   ///< one sentence
};

struct Report {
  int world_size = 0;
  std::vector<int> ranks_with_files;
  std::vector<GroupReport> groups;
  std::vector<int> behind;  ///< every group's, without repeats
};

Report analyze(const std::vector<Dump>& dumps);
std::string format_text(const std::vector<Dump>& dumps, const Report& report);
std::string format_json(const Report& report);

}  // namespace fsdp::trace
