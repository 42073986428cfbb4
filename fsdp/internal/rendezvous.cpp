#include "fsdp/internal/rendezvous.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/env.h"

#include "fsdp/env.h"
#include "fsdp/internal/comm.h"
#include "fsdp/internal/monitor.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

namespace fsdp::detail {
namespace {

using clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

milliseconds left(clock::time_point deadline) {
  return std::max(milliseconds(1), std::chrono::duration_cast<milliseconds>(deadline - clock::now()));
}

std::vector<uint8_t> bytes(const std::string& s) {
  return {s.begin(), s.end()};
}
std::string text(const std::vector<uint8_t>& v) {
  return {v.begin(), v.end()};
}

// What the start-up thread and the waiting caller share. The thread may outlive the caller (a
// store handshake that never ends): everything it touches is here, kept alive by shared_ptr.
struct Progress {
  std::mutex mu;
  std::condition_variable cv;
  std::string stage = "connecting to the job's store";
  std::string found;  // the latest probe of the store's address
  bool done = false;
  bool fatal = false;      // found something that waiting will not change (a name that does not resolve)
  bool abandoned = false;  // the caller gave up: the thread must not claim a rank or connect Gloo after it
  std::exception_ptr error;
  Rendezvous result;
  // Moves to the next stage, unless the caller gave up (then the thread stops here).
  void set_stage(const std::string& s) {
    std::lock_guard<std::mutex> l(mu);
    if (abandoned) throw std::runtime_error("abandoned");
    stage = s;
  }
};

std::string where(const LaunchEnv& env) {
  return "rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size);
}

std::string endpoint(const LaunchEnv& env, const std::string& method) {
  if (method.rfind("file://", 0) == 0) return "the store file " + method.substr(7);
  return "the store at " + env.master_addr + ":" + std::to_string(env.master_port);
}

// A rank that is not the store's host may get here before the host listens (rank 0 started a
// little later): c10d's client then retries only after a backoff of 250 to 750 ms (c10d/Backoff.hpp:
// 500 ms, +-50%), which was most of an elastic restart's process-group phase in 8 of 20 restarts
// measured. So wait for the port to accept, looking every 10 ms, until `until`; c10d's client then
// connects at once. Anything but "refused" (accepted, unreachable, a name that does not resolve) is
// left to the client and its own error.
void wait_until_listening(const std::string& host, int port, clock::time_point until) {
  while (clock::now() < until) {
    const Probe p = probe_endpoint(host, port, std::min(milliseconds(200), left(until)));
    if (!p.refused) return;
    std::this_thread::sleep_for(milliseconds(10));
  }
}

c10::intrusive_ptr<c10d::Store> make_store(const LaunchEnv& env, const InitOptions& options, milliseconds timeout) {
  const std::string& method = options.init_method();
  if (method.rfind("file://", 0) == 0) return c10::make_intrusive<c10d::FileStore>(method.substr(7), env.world_size);
  if (env.world_size == 1) return c10::make_intrusive<c10d::HashStore>();
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(env.master_port);
  so.isServer = env.rank == 0 && !env.agent_store;
  so.numWorkers = env.world_size;
  so.waitWorkers = false;
  // Longer than the caller waits: the caller gives up first, with its own message, and c10d's
  // client does not log its own timeout (with a backtrace) on the way.
  so.timeout = timeout + std::chrono::seconds(30);
  so.multiTenant = true;
  if (!so.isServer) wait_until_listening(env.master_addr, env.master_port, clock::now() + timeout);
  try {
    return c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  } catch (const std::exception& e) {
    if (so.isServer) {
      FSDP_CHECK(false, "fsdp::init_process_group: ", where(env), " could not host the job's store on ",
                 env.master_addr, ":", env.master_port, " (", error_text(e),
                 "). Another process holds that port (an earlier job, or another service): choose a free "
                 "MASTER_PORT.");
    }
    throw;
  }
}

// This rank's claim on the job: the job's identity and size first (a store another job owns is
// refused), then its own rank (a second process with the same rank is refused, naming both).
void claim(c10d::Store& store, const std::string& prefix, const LaunchEnv& env, const std::string& at) {
  const std::string id = job_id();
  const std::string job =
      "job '" + (id.empty() ? std::string("(no id)") : id) + "' of " + std::to_string(env.world_size) + " ranks";
  const std::string owner = text(store.compareSet(prefix + "job", {}, bytes(job)));
  FSDP_CHECK(owner == job, "fsdp::init_process_group: ", where(env), " (", job, ") reached ", at,
             ", which belongs to another job (", owner,
             "). Two jobs share MASTER_ADDR/MASTER_PORT: give each job its own MASTER_PORT (and each rank of one "
             "job the same FSDP_JOB_ID, or none).");
  const std::string self = host_and_pid();
  const std::string holder = text(store.compareSet(prefix + "rank/" + std::to_string(env.rank), {}, bytes(self)));
  FSDP_CHECK(holder == self, "fsdp::init_process_group: ", where(env), " (process ", self,
             ") is already taken by process ", holder, " at ", at,
             ". A second job was started on the same MASTER_ADDR/MASTER_PORT, or two processes were given the same "
             "rank: give each job its own MASTER_PORT (a store file left by an earlier run must be deleted).");
}

// Waits until every rank has claimed its rank; at `deadline`, names the ones that did not.
void wait_for_ranks(c10d::Store& store, const std::string& prefix, const LaunchEnv& env, const std::string& at,
                    clock::time_point deadline, milliseconds timeout) {
  if (store.add(prefix + "joined", 1) == env.world_size) store.set(prefix + "ready", bytes("1"));
  try {
    store.wait({prefix + "ready"}, left(deadline));
    return;
  } catch (const std::exception&) {
  }
  std::vector<int> missing;
  for (int r = 0; r < env.world_size && clock::now() < deadline + milliseconds(500); ++r) {
    if (!store.check({prefix + "rank/" + std::to_string(r)})) missing.push_back(r);
  }
  std::ostringstream os;
  for (size_t i = 0; i < missing.size() && i < 16; ++i) os << (i ? ", " : "") << missing[i];
  if (missing.size() > 16) os << ", ... (" << missing.size() << " ranks)";
  FSDP_CHECK(false, "fsdp::init_process_group: ", where(env), " waited for the other ranks at ", at,
             " until its timeout (", timeout.count(), " ms); ", env.world_size - static_cast<int>(missing.size()),
             " of ", env.world_size, " joined, missing: ", os.str(),
             ". Check that every rank was started (the launcher's log), with the same WORLD_SIZE and MASTER_ADDR/"
             "MASTER_PORT.");
}

c10::intrusive_ptr<c10d::Backend> connect_gloo(const c10::intrusive_ptr<c10d::Store>& store, const LaunchEnv& env,
                                               const InitOptions& options, milliseconds collective_timeout,
                                               clock::time_point deadline) {
  auto gloo_opts = c10d::ProcessGroupGloo::Options::create(left(deadline));
  std::string iface = options.gloo_interface();
  if (iface.empty()) {
    if (const char* e = getenv_or_null("GLOO_SOCKET_IFNAME")) iface = e;
  }
  if (!iface.empty()) {
    gloo_opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(iface));
  } else if (env.world_size == 1) {
    gloo_opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    gloo_opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  // Gloo's own worker threads; two are plenty for the CPU path and keep 4 ranks on 2 cores calm.
  gloo_opts->threads = 2;
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("gloo", store),
                                                          env.rank, env.world_size, gloo_opts);
  gloo->setTimeout(collective_timeout);  // connected: from now on, the collectives' bound
  return gloo;
}

}  // namespace

Probe probe_endpoint(const std::string& host, int port, milliseconds budget) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) {
    // A name that does not resolve will not start resolving, unless the resolver said "try again".
    return {std::string("the address '") + host + "' does not resolve (" + gai_strerror(rc) + ")", rc != EAI_AGAIN};
  }
  std::string found = "no answer from " + host + ":" + std::to_string(port);
  bool refused = false;
  const auto until = clock::now() + budget;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int err = 0;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        pollfd p{fd, POLLOUT, 0};
        const int n = poll(&p, 1, static_cast<int>(std::max<int64_t>(1, left(until).count())));
        socklen_t len = sizeof(err);
        if (n <= 0) {
          err = ETIMEDOUT;
        } else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
          err = errno;
        }
      }
    }
    close(fd);
    if (err == 0) {
      freeaddrinfo(res);
      Probe accepted{"a service at " + host + ":" + std::to_string(port) +
                     " accepted the connection but did not answer as a c10d store: that port is probably used by "
                     "another service (Slurm's and c10d's default 29500 often is); choose a free MASTER_PORT"};
      accepted.accepted = true;
      return accepted;
    }
    refused = err == ECONNREFUSED;
    if (err == ECONNREFUSED) {
      found = "nothing listens on " + host + ":" + std::to_string(port) +
              " (connection refused): the store's host (torchrun's agent, or rank 0) has not started or has exited, "
              "or MASTER_ADDR/MASTER_PORT point elsewhere";
    } else {
      found = "no answer from " + host + ":" + std::to_string(port) + " (" + std::strerror(err) +
              "): the host is down or unreachable, or a firewall or a cut link drops the traffic";
    }
  }
  freeaddrinfo(res);
  Probe out{found};
  out.refused = refused;
  return out;
}

Rendezvous rendezvous(const LaunchEnv& env, const InitOptions& options, milliseconds timeout) {
  const auto start = clock::now();
  const auto deadline = start + timeout;
  const std::string at = endpoint(env, options.init_method());
  const bool tcp = options.init_method().rfind("file://", 0) != 0 && env.world_size > 1;
  // torchrun's restarts may reuse its store: each restart claims ranks afresh. A membership change
  // restarts the workers without counting a restart: the world size tells those apart.
  const char* restart = getenv_or_null("TORCHELASTIC_RESTART_COUNT");
  const std::string prefix =
      std::string("fsdp/") + (restart != nullptr ? restart : "0") + "." + std::to_string(env.world_size) + "/";

  if (env.world_size == 1 && options.init_method().rfind("file://", 0) != 0) {
    // One process: an in-memory store and a loopback Gloo device, nothing that can block.
    Rendezvous r;
    r.prefix = prefix;
    r.store = make_store(env, options, timeout);
    r.scoped = c10::make_intrusive<c10d::PrefixStore>(prefix + "pg", r.store);
    r.gloo = connect_gloo(r.scoped, env, options, timeout, clock::now() + timeout);
    return r;
  }
  auto progress = std::make_shared<Progress>();
  // The start-up runs on a thread of its own, so that this one can give up at the deadline even
  // when the store's handshake never returns (a service on the port that accepts and stays silent).
  std::thread([progress, env, options, timeout, deadline, prefix, at] {
    try {
      Rendezvous r;
      r.prefix = prefix;
      r.store = make_store(env, options, left(deadline));
      r.store->setTimeout(left(deadline));
      // Gloo's keys ("gloo/0/<rank>": each rank's listening address) go under this attempt's
      // prefix: without it a restarted rank can read the address of the process it replaces
      // (still in the agent's store) and connect to a dead port, or wait for a peer that waits too.
      r.scoped = c10::make_intrusive<c10d::PrefixStore>(prefix + "pg", r.store);
      progress->set_stage("connected to the job's store");
      if (env.world_size > 1) {
        progress->set_stage("checking this rank's claim on the job");
        claim(*r.store, prefix, env, at);
        progress->set_stage("waiting for every rank to join");
        wait_for_ranks(*r.store, prefix, env, at, deadline - milliseconds(300), timeout);
        progress->set_stage("connecting Gloo to every rank");
      }
      r.gloo = connect_gloo(r.scoped, env, options, timeout, deadline);
      r.store->setTimeout(timeout);
      progress->set_stage("done");
      std::lock_guard<std::mutex> l(progress->mu);
      progress->result = std::move(r);
      progress->done = true;
      progress->cv.notify_all();
    } catch (...) {
      std::lock_guard<std::mutex> l(progress->mu);
      progress->error = std::current_exception();
      progress->done = true;
      progress->cv.notify_all();
    }
  }).detach();

  std::unique_lock<std::mutex> l(progress->mu);
  // While the store is not reached, look at what answers at its address (from its own thread: a
  // name lookup can block too), so that the error can say what was found there.
  const auto probe_after = start + std::min(milliseconds(1000), timeout / 4);
  bool probe_due = tcp;
  while (!progress->done && !progress->fatal && clock::now() < deadline) {
    if (probe_due && clock::now() >= probe_after) {
      probe_due = false;
      if (progress->stage != "connecting to the job's store") continue;
      std::thread([progress, host = env.master_addr, port = env.master_port, deadline] {
        while (true) {
          const Probe probe = probe_endpoint(host, port, std::min(milliseconds(1000), left(deadline)));
          std::unique_lock<std::mutex> g(progress->mu);
          progress->found = probe.found;
          if (probe.permanent) progress->fatal = true;  // fail now
          progress->cv.notify_all();
          if (progress->done || progress->fatal || clock::now() + milliseconds(1500) > deadline) return;
          progress->cv.wait_for(g, milliseconds(1000));
        }
      }).detach();
    }
    progress->cv.wait_until(l, probe_due ? std::min(deadline, probe_after) : deadline);
  }
  if (progress->done && !progress->error) return progress->result;
  progress->abandoned = true;
  const auto waited = std::chrono::duration_cast<milliseconds>(clock::now() - start).count();
  std::string cause;
  if (progress->error) {
    try {
      std::rethrow_exception(progress->error);
    } catch (const fsdp::Error&) {
      throw;  // the library's own message is complete
    } catch (...) {
      cause = error_text(std::current_exception());  // c10d's get this rank's context around them
    }
  }
  std::ostringstream os;
  os << "fsdp::init_process_group: " << where(env) << " could not join its job through " << at << " within "
     << timeout.count() << " ms (stopped after " << waited << " ms, while " << progress->stage << ")";
  if (!progress->found.empty()) os << ": " << progress->found;
  if (!cause.empty())
    os << (progress->found.empty() ? ": " : ". The store client said: ") << cause.substr(0, cause.find('\n'));
  os << ". The timeout is InitOptions::timeout, else $FSDP_TIMEOUT seconds, else 10 minutes.";
  FSDP_CHECK(false, os.str());
}

}  // namespace fsdp::detail
