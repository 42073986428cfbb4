#include "fsdp/internal/monitor.h"

#include "fsdp/error.h"
#include "fsdp/internal/flight_recorder.h"
#include "fsdp/internal/foreign_errors.h"
#include "fsdp/internal/heartbeat_record.h"

#include <c10/util/Exception.h>

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

namespace fsdp::detail {
namespace {

using std::chrono::milliseconds;
constexpr milliseconds kPeriod{1000};  // one store write per rank per second
constexpr milliseconds kStale{2500};   // a heartbeat older than this: the rank is not running
constexpr milliseconds kDiagnosisStoreTimeout{2000};
constexpr milliseconds kDiagnosisBudget{3000};
// Without torchrun's agent, rank 0 hosts the store: when it exits after a failure of its own, the
// others cannot tell more. The first failure is then in the other ranks' output.
constexpr const char* kStoreGone =
    "the process hosting it (rank 0, or the torchrun agent) has exited (perhaps after a failure of its own: the "
    "first failure is in the other ranks' output), is stopped, or the link to its host is down.";

// Shared by one heartbeat thread and the rest of the process; the thread keeps it alive.
struct Beat {
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  bool exiting = false;  // the process is exiting: one last heartbeat says so
  bool exited = false;   // the thread has left the store (and released it)
  std::string activity;  // "" when idle
  int64_t activity_since = 0;
  std::string failure;
};

struct Monitor {
  std::mutex mu;
  std::shared_ptr<Beat> beat;
  c10::intrusive_ptr<c10d::Store> diag_store;  // a connection of its own, with a short timeout
  std::string prefix;
  std::vector<c10::intrusive_ptr<c10d::Backend>> abandoned;
};

constexpr int kMaxFailedBeats = 3;  // then the store is gone: stop (c10d logs every failed write)

// Never destroyed: the heartbeat thread and abandoned backends may outlive every static.
Monitor& monitor() {
  static auto* m = new Monitor();
  return *m;
}

std::shared_ptr<Beat> current_beat() {
  Monitor& m = monitor();
  std::lock_guard<std::mutex> g(m.mu);
  return m.beat;
}

// Stops the heartbeat before static destructors run (registered after LibTorch's statics exist,
// so it runs before they are destroyed); waits briefly for the thread to leave the store.
// The last heartbeat says the process exited (a peer that finished early is then told so, not
// that this rank "stopped answering"), and every store connection of the library is released, so
// that a file store is removed as c10d intends when its last user is gone.
void stop_at_exit() {
  auto b = current_beat();
  {
    Monitor& m = monitor();
    std::lock_guard<std::mutex> g(m.mu);
    m.diag_store.reset();
  }
  if (!b) return;
  std::unique_lock<std::mutex> l(b->mu);
  b->exiting = true;
  b->stop = true;
  b->cv.notify_all();
  b->cv.wait_for(l, milliseconds(200), [&] { return b->exited; });
}

std::string key_of(const std::string& prefix, int rank) {
  return prefix + "heartbeat/" + std::to_string(rank);
}

// This process's pid namespace ("pid:[4026531836]"), or "": a peer's pid names a process here only
// when the peer's host and pid namespace are this process's.
std::string pid_namespace() {
  char buf[128];
  const ssize_t n = ::readlink("/proc/self/ns/pid", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

using PeerBeat = Heartbeat;

// Whether the peer's process is gone from this host: the same host and pid namespace, and its pid
// no longer a live process (none, or a zombie not yet reaped). A peer killed a moment ago is named
// at once this way, without waiting for its heartbeat to go stale.
bool gone_here(const PeerBeat& b, const std::string& host, const std::string& ns) {
  if (b.exited || ns.empty() || b.ns != ns) return false;
  const size_t colon = b.who.rfind(':');
  if (colon == std::string::npos || b.who.substr(0, colon) != host) return false;
  int pid = 0;
  try {
    pid = std::stoi(b.who.substr(colon + 1));
  } catch (const std::exception&) {
    return false;
  }
  if (pid <= 1) return false;
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  return close != std::string::npos && close + 2 < text.size() && (text[close + 2] == 'Z' || text[close + 2] == 'X');
}

std::string seconds(int64_t ms) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", static_cast<double>(ms) / 1000.0);
  return buf;
}

// What a peer's heartbeat says it was doing; `now` is when its state is described (0: as of its
// last heartbeat, without a duration).
std::string doing(const PeerBeat& b, int64_t now) {
  if (b.exited && !b.failure.empty()) return "it failed in " + b.failure + " and exited";
  if (b.exited) return "its process exited (it returned from main: did it run fewer steps than this rank?)";
  if (!b.failure.empty()) return "it failed in " + b.failure;
  if (b.activity.empty()) return "it was not inside a collective of this library";
  if (now == 0) return "it was in " + b.activity;
  return "it is in " + b.activity + " for " + seconds(now - b.activity_since);
}

}  // namespace

int64_t unix_ms() {
  return std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_and_pid() {
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "?");
  return std::string(host) + ":" + std::to_string(getpid());
}

void start_heartbeat(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix, int rank) {
  Monitor& m = monitor();
  auto beat = std::make_shared<Beat>();
  c10::intrusive_ptr<c10d::Store> diag;
  try {
    diag = store->clone();
    diag->setTimeout(kDiagnosisStoreTimeout);
  } catch (const std::exception&) {
    diag = store;  // a store that cannot clone itself: diagnosis shares the heartbeat's connection
  }
  {
    std::lock_guard<std::mutex> g(m.mu);
    if (m.beat) {  // a previous process group's heartbeat: its thread ends at its next wake-up
      std::lock_guard<std::mutex> l(m.beat->mu);
      m.beat->stop = true;
      m.beat->cv.notify_all();
    }
    m.beat = beat;
    m.diag_store = diag;
    m.prefix = prefix;
  }
  static std::once_flag at_exit;
  std::call_once(at_exit, [] { std::atexit(stop_at_exit); });
  const std::string key = key_of(prefix, rank);
  const std::string who = host_and_pid(), ns = pid_namespace();
  std::thread([beat, conn = store, key, who, ns]() mutable {
    int64_t seq = 0;
    int failed = 0;
    std::unique_lock<std::mutex> l(beat->mu);
    while (failed < kMaxFailedBeats) {
      const bool last = beat->stop;
      if (last && !beat->exiting) break;  // replaced by a newer process group's heartbeat
      const std::string value = encode_heartbeat(seq++, unix_ms(), who, ns, beat->activity_since, beat->activity,
                                                 beat->exiting, last_collective(), beat->failure);
      l.unlock();
      try {
        conn->set(key, std::vector<uint8_t>(value.begin(), value.end()));
        failed = 0;
      } catch (...) {
        ++failed;  // the store is gone or slow (its host died); diagnosis reports it
      }
      l.lock();
      if (last) break;
      beat->cv.wait_for(l, kPeriod, [&] { return beat->stop; });
    }
    conn.reset();
    beat->exited = true;
    beat->cv.notify_all();
  }).detach();
}

Activity::Activity(const std::string& what) {
  if (auto b = current_beat()) {
    std::lock_guard<std::mutex> l(b->mu);
    b->activity = what;
    b->activity_since = unix_ms();
  }
}

Activity::~Activity() {
  if (auto b = current_beat()) {
    std::lock_guard<std::mutex> l(b->mu);
    b->activity.clear();
  }
}

void note_failure(const std::string& what) {
  if (auto b = current_beat()) {
    std::lock_guard<std::mutex> l(b->mu);
    if (b->failure.empty()) b->failure = what;
  }
}

namespace {

// The diagnosis itself; its store operations may block without end (c10d's TCPStore client waits
// on its socket without a timeout, and a cut link makes that wait last as long as TCP retries).
// With `look_once`, only the peers' heartbeats as they are now (for a flight-recorder dump on a
// signal: nothing failed, there is nothing to diagnose).
PeerDiagnosis diagnose_unbounded(const std::vector<int>& global_ranks, int self, bool look_once) {
  c10::intrusive_ptr<c10d::Store> store;
  std::string prefix;
  {
    Monitor& m = monitor();
    std::lock_guard<std::mutex> g(m.mu);
    store = m.diag_store;
    prefix = m.prefix;
  }
  if (!store) return {};
  std::vector<int> peers;
  for (int r : global_ranks) {
    if (r != self) peers.push_back(r);
  }
  if (peers.empty()) return {};

  std::string store_error;
  auto read = [&](std::map<int, PeerBeat>& out) {
    std::vector<std::string> keys;
    keys.reserve(peers.size());
    for (int r : peers) keys.push_back(key_of(prefix, r));
    try {
      std::vector<std::vector<uint8_t>> values;
      if (store->check(keys)) {
        values = store->multiGet(keys);
      } else {
        for (const auto& k : keys) values.push_back(store->check({k}) ? store->get(k) : std::vector<uint8_t>{});
      }
      for (size_t i = 0; i < peers.size(); ++i) {
        PeerBeat b;
        if (!values[i].empty() && decode_heartbeat(values[i], b)) out[peers[i]] = b;
      }
      return true;
    } catch (const std::exception& e) {
      store_error = error_text(e);
      store_error = store_error.substr(0, store_error.find('\n'));
      return false;
    }
  };

  std::map<int, PeerBeat> first, second;
  if (!read(first)) {
    return {"The job's store did not answer the peer check (" + store_error + "): " + kStoreGone};
  }
  int64_t now = unix_ms();
  if (look_once) return {"", -1, first, {}, now};
  std::vector<int> stale;
  std::set<int> gone;  // processes of this host that no longer exist
  const std::string self_who = host_and_pid(), host = self_who.substr(0, self_who.rfind(':')), ns = pid_namespace();
  for (int r : peers) {
    auto it = first.find(r);
    if (it == first.end()) continue;
    if (gone_here(it->second, host, ns)) gone.insert(r);
    if (it->second.exited || now - it->second.at_ms > kStale.count() || gone.count(r)) stale.push_back(r);
  }
  if (stale.empty()) {
    // A peer killed a moment ago still has a fresh heartbeat: look again after two periods, and
    // name the ones whose counter did not move.
    std::this_thread::sleep_for(kPeriod + kPeriod / 2);
    if (!read(second)) {
      return {"The job's store stopped answering during the peer check (" + store_error + "): " + kStoreGone};
    }
    now = unix_ms();
    for (int r : peers) {
      auto a = first.find(r), b = second.find(r);
      // Stopped (its counter did not move), or exited since the first look.
      const bool stopped = a != first.end() && b != second.end() && a->second.seq == b->second.seq;
      if (stopped || (b != second.end() && b->second.exited)) stale.push_back(r);
    }
  }
  std::ostringstream os;
  int likely = -1;
  std::vector<int> missing;
  for (int r : peers) {
    if (first.count(r) == 0) missing.push_back(r);
  }
  if (!stale.empty()) {
    // The ranks that stopped without a failure of their own first: the likely cause. Ranks that
    // failed too (and then exited) follow.
    auto beat_of = [&](int r) -> const PeerBeat& { return second.count(r) ? second[r] : first[r]; };
    std::stable_partition(stale.begin(), stale.end(), [&](int r) { return beat_of(r).failure.empty(); });
    likely = stale.front();
    for (size_t i = 0; i < stale.size() && i < 8; ++i) {
      const PeerBeat& b = beat_of(stale[i]);
      os << (i == 0 ? "" : " ") << "Peer rank " << stale[i] << " (" << b.who << ")";
      if (!b.failure.empty()) {
        os << " failed too, in " << b.failure << (b.exited ? ", and exited." : ", and stopped answering.");
      } else if (b.exited) {
        os << " has exited: " << doing(b, 0) << ".";
      } else if (gone.count(stale[i]) != 0) {
        os << " stopped answering: its process no longer exists on this host (it was killed or crashed), when "
           << doing(b, 0) << ".";
      } else {
        os << " stopped answering: its last heartbeat is " << seconds(now - b.at_ms) << " old, when " << doing(b, 0)
           << " (it was killed or stopped, or its host or link is down).";
      }
      if (b.last.known()) os << " Its last collective: " << b.last.text() << '.';
    }
    if (stale.size() > 8) os << " And " << stale.size() - 8 << " more ranks.";
  } else {
    os << "Every other rank of the job still runs (heartbeats under " << seconds(kStale.count()) << " old):";
    int shown = 0;
    for (int r : peers) {
      auto it = second.find(r);
      if (it == second.end() || shown == 6) continue;
      os << (shown++ ? ";" : "") << " rank " << r << ": " << doing(it->second, now);
    }
    os << ". A rank may have taken another code path, or be stuck outside this library.";
  }
  if (!missing.empty()) {
    os << " Ranks without a heartbeat:";
    for (size_t i = 0; i < missing.size() && i < 8; ++i) os << ' ' << missing[i];
    os << '.';
  }
  std::map<int, Heartbeat> beats = second.empty() ? first : second;
  return {os.str(), likely, std::move(beats), std::set<int>(stale.begin(), stale.end()), now};
}

struct Diagnosis {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  PeerDiagnosis found;
};

}  // namespace

namespace {

PeerDiagnosis bounded_look(const std::vector<int>& global_ranks, int self, bool look_once) {
  {
    Monitor& m = monitor();
    std::lock_guard<std::mutex> g(m.mu);
    if (!m.diag_store) return {};
  }
  // On a thread of its own, so that a store that does not answer costs a bounded wait.
  auto d = std::make_shared<Diagnosis>();
  std::thread([d, global_ranks, self, look_once] {
    PeerDiagnosis found;
    try {
      found = diagnose_unbounded(global_ranks, self, look_once);
    } catch (const std::exception& e) {  // said, never an empty diagnosis that looks like "nothing known"
      const std::string why = error_text(e);
      found.text = "The peer check failed (" + why.substr(0, why.find('\n')) + "): " + kStoreGone;
    } catch (...) {
      found.text = std::string("The peer check failed: ") + kStoreGone;
    }
    std::lock_guard<std::mutex> l(d->mu);
    d->found = std::move(found);
    d->done = true;
    d->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> l(d->mu);
  if (d->cv.wait_for(l, kDiagnosisBudget, [&] { return d->done; })) return d->found;
  return {"The job's store did not answer the peer check within " + seconds(kDiagnosisBudget.count()) + ": " +
          kStoreGone};
}

}  // namespace

PeerDiagnosis diagnose_peers(const std::vector<int>& global_ranks, int self) {
  return bounded_look(global_ranks, self, false);
}

PeerDiagnosis peer_states(const std::vector<int>& global_ranks, int self) {
  return bounded_look(global_ranks, self, true);
}

namespace {
std::terminate_handler g_previous_terminate = nullptr;
int g_rank_for_terminate = -1;

void terminate_with_explanation() {
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      const std::string what = ex.what();
      if (recognize_foreign_error(what) == ForeignError::kCollectiveMismatch) {
        std::fprintf(stderr,
                     "fsdp: Gloo aborts this process (rank %d): a peer sent a collective of another size than this "
                     "rank expected, so the ranks issued different collectives inside a forward or backward (a "
                     "unit called on some ranks only, units in another order, different unused parameters). "
                     "Gloo's transport thread throws where nothing can catch it. Run again with "
                     "FSDP_VERIFY_COLLECTIVES=1: every rank then fails with an error naming the first collective "
                     "that differs. Gloo said: %s\n",
                     g_rank_for_terminate, what.c_str());
      }
    } catch (...) {
    }
  }
  if (g_previous_terminate != nullptr) g_previous_terminate();
  std::abort();
}
}  // namespace

void explain_gloo_aborts(int rank) {
  static std::once_flag once;
  g_rank_for_terminate = rank;
  std::call_once(once, [] { g_previous_terminate = std::set_terminate(terminate_with_explanation); });
}

void abandon_backend(const c10::intrusive_ptr<c10d::Backend>& backend) {
  if (!backend) return;
  Monitor& m = monitor();
  std::lock_guard<std::mutex> g(m.mu);
  for (const auto& b : m.abandoned) {
    if (b.get() == backend.get()) return;
  }
  m.abandoned.push_back(backend);
}

}  // namespace fsdp::detail
