// The flight recorder's ring, its configuration from the environment, and the dump on a signal
// (fsdp/internal/flight_recorder.h). The dump itself is in flight_recorder_dump.cpp.
#include "fsdp/internal/flight_recorder.h"

#include "fsdp/internal/env.h"
#include "fsdp/internal/monitor.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

namespace fsdp::detail {
namespace {

struct Recorder {
  std::mutex mu;
  std::vector<TraceEntry> ring;  // slot seq % size; its size is the capacity (0: off)
  int64_t next = 0;              // the next entry's seq
  std::map<std::string, std::shared_ptr<TraceGroup>> groups;
  int rank = -1;
  int world_size = 0;
};

// Never destroyed: the signal thread and the heartbeat thread may read it during exit.
Recorder& recorder() {
  static auto* r = new Recorder();
  return *r;
}

// The signal handler's end of the self-pipe: writing a byte is all it does (async-signal-safe).
int g_signal_pipe_write = -1;

void on_dump_signal(int /*sig*/) {
  const int saved = errno;
  const char byte = 1;
  if (g_signal_pipe_write >= 0) (void)!::write(g_signal_pipe_write, &byte, 1);
  errno = saved;
}

// Blocks on the pipe; each byte is one dump. Detached: it never keeps the process alive, and
// nothing it does can end the process (every error is printed and forgotten).
void dump_on_signal_thread(int read_fd, std::string name) {
  for (;;) {
    char byte = 0;
    const ssize_t n = ::read(read_fd, &byte, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    try {
      int rank = -1, world = 0;
      trace_identity(rank, world);
      std::vector<int> everyone;
      for (int q = 0; q < world; ++q) everyone.push_back(q);
      const PeerDiagnosis peers = rank >= 0 ? peer_states(everyone, rank) : PeerDiagnosis{};
      const DumpResult d = dump_flight_record("signal " + name, peers);
      if (!d.path.empty()) {
        std::fprintf(stderr,
                     "fsdp: rank %d wrote its flight record to %s (signal %s); read every rank's with: fsdp-trace %s\n",
                     rank, d.path.c_str(), name.c_str(), trace_dir().c_str());
      } else if (!d.error.empty()) {
        std::fprintf(stderr, "fsdp: rank %d could not write its flight record on signal %s: %s\n", rank, name.c_str(),
                     d.error.c_str());
      }
    } catch (...) {
      std::fprintf(stderr, "fsdp: the flight recorder's dump on signal %s failed\n", name.c_str());
    }
  }
}

void install_dump_signal(int sig) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    std::fprintf(stderr, "fsdp: FSDP_DUMP_ON_SIGNAL: no pipe for the signal (%s); no dump on signal\n",
                 std::strerror(errno));
    return;
  }
  g_signal_pipe_write = fds[1];
  const std::string name = sig == SIGUSR1 ? "SIGUSR1" : sig == SIGUSR2 ? "SIGUSR2" : std::to_string(sig);
  std::thread(dump_on_signal_thread, fds[0], name).detach();
  struct sigaction sa {};
  sa.sa_handler = on_dump_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // the program's own system calls go on as if nothing happened
  ::sigaction(sig, &sa, nullptr);
}

std::once_flag g_init;

}  // namespace

const char* trace_state_name(TraceState s) {
  switch (s) {
    case TraceState::kIssued:
      return "issued";
    case TraceState::kCompleted:
      return "completed";
    case TraceState::kEnqueued:
      return "enqueued";
    case TraceState::kFailed:
      return "failed";
    case TraceState::kTimedOut:
      return "timed out";
  }
  return "?";
}

void init_flight_recorder() {
  std::call_once(g_init, [] {
    // Both parsed before anything changes: a malformed one throws, and call_once runs again next time.
    const size_t size = flight_recorder_size_from_env();
    const int sig = dump_signal_from_env();
    {
      Recorder& r = recorder();
      std::lock_guard<std::mutex> g(r.mu);
      r.ring.assign(size, TraceEntry{});
    }
    if (sig != 0) install_dump_signal(sig);
  });
}

void set_trace_identity(int global_rank, int world_size) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> g(r.mu);
  r.rank = global_rank;
  r.world_size = world_size;
}

void trace_identity(int& global_rank, int& world_size) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> g(r.mu);
  global_rank = r.rank;
  world_size = r.world_size;
}

std::shared_ptr<TraceGroup> trace_group(const std::string& name, const std::vector<int>& global_ranks,
                                        bool background) {
  std::string key = name + ":";
  for (int q : global_ranks) key += std::to_string(q) + ",";
  Recorder& r = recorder();
  std::lock_guard<std::mutex> g(r.mu);
  auto& group = r.groups[key];
  if (!group) group = std::make_shared<TraceGroup>(TraceGroup{name, global_ranks, 0, background});
  return group;
}

int64_t trace_issue(const std::shared_ptr<TraceGroup>& group, const char* op, const std::string& what, int64_t numel,
                    int64_t bytes, c10::ScalarType dtype, c10::Device device) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> g(r.mu);
  const int64_t group_seq = group->issued++;  // counted even when off: numbers stay comparable
  if (r.ring.empty()) return -1;
  TraceEntry& e = r.ring[static_cast<size_t>(r.next) % r.ring.size()];
  e.seq = r.next++;
  if (e.group != group) e.group = group;
  e.group_seq = group_seq;
  e.op = op;
  e.what.assign(what);
  e.numel = numel;
  e.bytes = bytes;
  e.dtype = dtype;
  e.device = device;
  e.issued_ms = unix_ms();
  e.ended_ms = 0;
  e.state = TraceState::kIssued;
  return e.seq;
}

void trace_end(int64_t seq, TraceState state) {
  if (seq < 0) return;
  Recorder& r = recorder();
  std::lock_guard<std::mutex> g(r.mu);
  if (r.ring.empty()) return;
  TraceEntry& e = r.ring[static_cast<size_t>(seq) % r.ring.size()];
  if (e.seq != seq) return;  // overwritten since
  e.state = state;
  e.ended_ms = unix_ms();
}

LastCollective last_collective() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> g(r.mu);
  const auto n = static_cast<int64_t>(r.ring.size());
  for (int64_t s = r.next - 1; s >= 0 && s >= r.next - n; --s) {
    const TraceEntry& e = r.ring[static_cast<size_t>(s % n)];
    if (e.group && e.group->background) continue;
    return {e.seq, e.group ? e.group->name : "", e.group_seq, e.op, e.what, trace_state_name(e.state)};
  }
  return {};
}

std::vector<TraceEntry> trace_entries() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> g(r.mu);
  std::vector<TraceEntry> out;
  const int64_t n = static_cast<int64_t>(r.ring.size());
  for (int64_t s = std::max<int64_t>(0, r.next - n); s < r.next; ++s) out.push_back(r.ring[static_cast<size_t>(s % n)]);
  return out;
}

size_t trace_capacity() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> g(r.mu);
  return r.ring.size();
}

int64_t trace_recorded() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> g(r.mu);
  return r.next;
}

void reset_flight_recorder_for_testing(size_t capacity) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> g(r.mu);
  r.ring.assign(capacity, TraceEntry{});
  r.next = 0;
}

}  // namespace fsdp::detail
