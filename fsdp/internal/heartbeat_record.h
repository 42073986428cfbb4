// The heartbeat's record: what one rank publishes about itself in the job's store every second
// (fsdp/internal/monitor.cpp writes it; diagnose_peers and the flight recorder's dump read it). Its
// format lives here only, so that the writer and the readers cannot drift apart. Internal.
#pragma once

#include <cstdint>
#include <string>
#include <vector>
#include "fsdp/export.h"

namespace fsdp::detail {

/// A rank's last collective, as its flight recorder knows it (fsdp/internal/flight_recorder.h).
struct FSDP_TESTING_API LastCollective {
  int64_t seq = -1;        ///< the process-wide number; -1: none recorded (or the recorder is off)
  std::string group;       ///< "world", "hybrid shard group 1", ...
  int64_t group_seq = -1;  ///< the number within the group: comparable between the group's ranks
  std::string op;          ///< "all-gather", "agreement", ...
  std::string what;        ///< "all-gather of unit 'h.1' (...)"
  std::string state;       ///< "completed", "issued", ...
  bool known() const { return seq >= 0; }
  /// "#41 all-gather of unit 'h.1' (group world #12), completed"
  std::string text() const;
};

/// One heartbeat, decoded.
struct Heartbeat {
  int64_t seq = -1;   ///< the heartbeat's counter: it stops moving when the rank stops
  int64_t at_ms = 0;  ///< unix ms when it was written
  std::string who;    ///< host:pid
  std::string ns;     ///< pid namespace
  int64_t activity_since = 0;
  std::string activity;  ///< the collective waited in, "" when idle
  bool exited = false;
  std::string failure;
  LastCollective last;
};

/// "seq|unix_ms|host:pid|pid ns|activity_since|activity|exited|last collective|failure", the last
/// collective as "seq,group_seq,state,op,group,what" (empty when none). Bars in the text fields
/// become '/', so that only the failure (the last field) may hold any character.
FSDP_TESTING_API std::string encode_heartbeat(int64_t seq, int64_t now_ms, const std::string& who,
                                              const std::string& ns, int64_t activity_since,
                                              const std::string& activity, bool exited, const LastCollective& last,
                                              const std::string& failure);

/// False when `v` is not a heartbeat. A record without the last-collective field (eight fields,
/// an older writer) reads with `last` unknown.
FSDP_TESTING_API bool decode_heartbeat(const std::vector<uint8_t>& v, Heartbeat& out);

}  // namespace fsdp::detail
