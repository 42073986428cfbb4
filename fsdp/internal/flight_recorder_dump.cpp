// The flight recorder's file (fsdp/internal/flight_recorder.h): one JSON document per rank,
// written atomically (a temporary file renamed over the old one), so that fsdp-trace never reads
// half a file, even when a rank dumps twice (a signal, then a timeout). The format is described
// in docs/usage.md ("When a run hangs: the flight recorder") and read by tools/trace_report.cpp.
#include "fsdp/internal/flight_recorder.h"
#include "fsdp/util/json_text.h"
#include "fsdp/util/make_dirs.h"

#include "fsdp/internal/env.h"
#include "fsdp/internal/monitor.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace fsdp::detail {
namespace {

constexpr int kFormatVersion = 1;

void write_last(std::ostream& os, const LastCollective& l) {
  if (!l.known()) {
    os << "null";
    return;
  }
  os << "{\"seq\": " << l.seq << ", \"group\": " << util::json_string(l.group) << ", \"group_seq\": " << l.group_seq
     << ", \"op\": " << util::json_string(l.op) << ", \"what\": " << util::json_string(l.what)
     << ", \"state\": " << util::json_string(l.state) << "}";
}

// Which run wrote the file, so that fsdp-trace refuses to compare files of different runs left in
// one directory: torchrun's run id, the job's store address and the restart count (each may be
// missing: a process started by hand).
std::string job_identity() {
  auto env = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v != nullptr ? v : "");
  };
  return "run " + env("TORCHELASTIC_RUN_ID") + ", store " + env("MASTER_ADDR") + ":" + env("MASTER_PORT") +
         ", restart " + env("TORCHELASTIC_RESTART_COUNT");
}

std::string document(const std::string& reason, const PeerDiagnosis& peers, int rank, int world_size) {
  const std::vector<TraceEntry> entries = trace_entries();
  const std::string who = host_and_pid();
  const int64_t now = unix_ms();
  std::ostringstream os;
  os << "{\n  \"format\": \"fsdp-flight-recorder\",\n  \"version\": " << kFormatVersion << ",\n  \"rank\": " << rank
     << ",\n  \"world_size\": " << world_size << ",\n  \"job\": " << util::json_string(job_identity())
     << ",\n  \"host\": " << util::json_string(who.substr(0, who.rfind(':'))) << ",\n  \"pid\": " << ::getpid()
     << ",\n  \"dump_unix_ms\": " << now << ",\n  \"reason\": " << util::json_string(reason)
     << ",\n  \"capacity\": " << trace_capacity() << ",\n  \"recorded\": " << trace_recorded() << ",\n  \"entries\": [";
  for (size_t i = 0; i < entries.size(); ++i) {
    const TraceEntry& e = entries[i];
    os << (i ? ",\n" : "\n") << "    {\"seq\": " << e.seq
       << ", \"group\": " << util::json_string(e.group ? e.group->name : "") << ", \"group_ranks\": [";
    if (e.group) {
      for (size_t q = 0; q < e.group->global_ranks.size(); ++q) os << (q ? ", " : "") << e.group->global_ranks[q];
    }
    os << "], \"group_seq\": " << e.group_seq << ", \"op\": " << util::json_string(e.op)
       << ", \"what\": " << util::json_string(e.what) << ", \"numel\": " << e.numel
       << ", \"dtype\": " << util::json_string(c10::toString(e.dtype)) << ", \"bytes\": " << e.bytes
       << ", \"device\": " << util::json_string(e.device.str()) << ", \"issued_unix_ms\": " << e.issued_ms
       << ", \"ended_unix_ms\": " << e.ended_ms << ", \"state\": " << util::json_string(trace_state_name(e.state))
       << "}";
  }
  os << (entries.empty() ? "" : "\n  ") << "],\n  \"peers\": [";
  bool first = true;
  for (const auto& [peer, b] : peers.beats) {
    os << (first ? "\n" : ",\n") << "    {\"rank\": " << peer << ", \"who\": " << util::json_string(b.who)
       << ", \"heartbeat_unix_ms\": " << b.at_ms << ", \"heartbeat_seq\": " << b.seq
       << ", \"stale\": " << (peers.stale.count(peer) ? "true" : "false")
       << ", \"exited\": " << (b.exited ? "true" : "false") << ", \"activity\": " << util::json_string(b.activity)
       << ", \"activity_since_unix_ms\": " << b.activity_since << ", \"failure\": " << util::json_string(b.failure)
       << ", \"last_collective\": ";
    write_last(os, b.last);
    os << "}";
    first = false;
  }
  os << (first ? "" : "\n  ") << "],\n  \"peers_read_unix_ms\": " << peers.read_at_ms
     << ",\n  \"diagnosis\": " << util::json_string(peers.text) << "\n}\n";
  return os.str();
}

}  // namespace

std::string trace_dir() {
  const char* d = getenv_or_null("FSDP_FLIGHT_RECORDER_DIR");
  std::string dir = d ? d : "/tmp/fsdp-trace";
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

std::string trace_file(int global_rank) {
  return trace_dir() + "/fsdp-trace-rank-" + std::to_string(global_rank) + ".json";
}

DumpResult dump_flight_record(const std::string& reason, const PeerDiagnosis& peers) {
  if (trace_capacity() == 0) return {};
  try {
    int rank = -1, world = 0;
    trace_identity(rank, world);
    const std::string dir = trace_dir();
    const std::string path =
        rank >= 0 ? trace_file(rank) : dir + "/fsdp-trace-pid-" + std::to_string(::getpid()) + ".json";
    if (std::string e = util::make_dirs(dir); !e.empty()) return {"", e};
    const std::string text = document(reason, peers, rank, world);
    // Unique per dump: the signal's thread and a failing collective may dump at the same time.
    static std::atomic<int64_t> dumps{0};
    const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(dumps++);
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return {"", "cannot create '" + tmp + "': " + std::strerror(errno)};
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const std::string e = std::strerror(errno);
        ::close(fd);
        ::unlink(tmp.c_str());
        return {"", "cannot write '" + tmp + "': " + e};
      }
      done += static_cast<size_t>(n);
    }
    ::close(fd);
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      const std::string e = std::strerror(errno);
      ::unlink(tmp.c_str());
      return {"", "cannot rename '" + tmp + "' to '" + path + "': " + e};
    }
    return {path, ""};
  } catch (const std::exception& e) {
    return {"", e.what()};
  }
}

}  // namespace fsdp::detail
