// The race switch (fsdp/internal/race_delay.h): the seed, the seeded delays and their count, and
// the CPU backend that runs each collective late on a thread of its own.
//
// Why a wrapper and not a sleep: Gloo runs a CPU collective on its worker thread and writes the
// caller's output as it finishes, usually within microseconds over loopback; a caller that reads
// too early mostly reads the right bytes by luck. The wrapper moves the two moments a missing
// wait depends on, when the inputs are read and when the output is written, to after seeded
// delays on its own thread, so that reading before wait() reads stale bytes nearly every time.
// A sleep on the caller's thread would do the opposite: give the collective time to finish.
#include "fsdp/internal/race_delay.h"

#include "fsdp/internal/check.h"
#include "fsdp/internal/comm.h"
#include "fsdp/internal/env.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace fsdp::detail {
namespace {

class RaceDelayBackend;

// Never destroyed: the exit handler and a backend's worker may read them during exit.
struct RaceState {
  std::once_flag env_read;
  std::atomic<uint64_t> seed{0};
  std::atomic<bool> ever_on{false};
  std::atomic<int64_t> applied{0};
  std::atomic<uint64_t> draws[3] = {};
  std::atomic<int> rank{-1};
  std::atomic<bool> read_before_wait{false};
  // The live wrappers, by the backend each wraps (race_delay_backend).
  std::mutex registry_mu;
  std::vector<std::pair<const c10d::Backend*, c10::weak_intrusive_ptr<RaceDelayBackend>>> registry;
};
RaceState& state() {
  static auto* s = new RaceState();
  return *s;
}

void print_at_exit() {
  RaceState& s = state();
  const int rank = s.rank.load();
  // A process that never delayed anything (alone, its collectives are copies) knows no rank.
  if (rank < 0) {
    std::fprintf(stderr, "fsdp: race delays applied: %lld (FSDP_RACE_DELAY)\n",
                 static_cast<long long>(s.applied.load()));
  } else {
    std::fprintf(stderr, "fsdp: race delays applied: %lld (FSDP_RACE_DELAY, global rank %d)\n",
                 static_cast<long long>(s.applied.load()), rank);
  }
}

void note_on(uint64_t seed) {
  if (seed == 0 || state().ever_on.exchange(true)) return;
  std::atexit(print_at_exit);
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

void sleep_for(std::chrono::microseconds d) {
  if (d.count() > 0) std::this_thread::sleep_for(d);
}

// Delay number `n` of `side` on `rank`, counted as applied: up to 1 ms before an issue; 0.1 to
// 2 ms on the communication and compute sides, never zero there, so that a read before the wait
// never passes by a draw of nothing.
std::chrono::microseconds race_delay_draw(RaceSide side, int rank, uint64_t n) {
  RaceState& s = state();
  const uint64_t seed = s.seed.load(std::memory_order_relaxed);
  if (seed == 0) return std::chrono::microseconds(0);
  const auto k = static_cast<uint64_t>(side);
  const uint64_t x = splitmix64(seed ^ splitmix64((static_cast<uint64_t>(rank) << 8 | k) ^ (n << 20)));
  s.rank = rank;
  ++s.applied;
  if (side == RaceSide::kIssue) return std::chrono::microseconds(static_cast<int64_t>(x % 1001));
  return std::chrono::microseconds(100 + static_cast<int64_t>(x % 1901));
}

// A collective of the wrapper: complete once the worker has written the caller's output.
class RaceWork final : public c10d::Work {
 public:
  RaceWork() : future_(c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get())) {}
  void finish_with(const std::exception_ptr& error) {
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue());
    }
  }
  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override {
    return future_->completed() && future_->hasError() ? future_->exception_ptr() : nullptr;
  }
  bool wait(std::chrono::milliseconds timeout) override {
    if (!future_->completed()) {
      if (timeout == ::kNoTimeout) {
        future_->wait();
      } else {
        auto done = std::make_shared<std::pair<std::mutex, std::condition_variable>>();
        auto flag = std::make_shared<bool>(false);
        future_->addCallback([done, flag](c10::ivalue::Future&) {
          std::lock_guard<std::mutex> l(done->first);
          *flag = true;
          done->second.notify_all();
        });
        std::unique_lock<std::mutex> l(done->first);
        if (!done->second.wait_for(l, timeout, [&] { return *flag; })) return false;
      }
    }
    if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A collective of the wrapper: run by the worker on staging tensors of `inner`; returns the
// (caller's tensor, result) pairs the worker copies once the collective is done.
using Copies = std::vector<std::pair<at::Tensor, at::Tensor>>;
struct Job {
  std::function<Copies(c10d::Backend& inner)> run;
  c10::intrusive_ptr<RaceWork> work;
};

// What the worker thread owns: the queue and the backend it issues into. Shared with the wrapper,
// so that a wrapper destroyed while a job still waits for its peers need not wait for it.
struct Queue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Job> jobs;
  bool stop = false;
  bool busy = false;  // a job is running
  c10::intrusive_ptr<c10d::Backend> inner;
  int rank = 0;
  uint64_t draws = 0;  // this worker's delays so far, drawn in issue order: one sequence per seed
};

void work_loop(const std::shared_ptr<Queue>& q) {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> l(q->mu);
      q->cv.wait(l, [&] { return q->stop || !q->jobs.empty(); });
      if (q->jobs.empty()) return;
      job = std::move(q->jobs.front());
      q->jobs.pop_front();
      q->busy = true;
    }
    std::exception_ptr error;
    try {
      // Raw memory, as Gloo writes it: no autograd, no version counter.
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      sleep_for(race_delay_draw(RaceSide::kComm, q->rank, q->draws++));  // then the inputs are read
      Copies copies = job.run(*q->inner);
      sleep_for(race_delay_draw(RaceSide::kComm, q->rank, q->draws++));  // then the output is written
      for (auto& [to, from] : copies) to.copy_(from);
    } catch (...) {
      error = std::current_exception();
    }
    job.work->finish_with(error);
    job = Job{};  // the caller's wait sees the work let go (Comm::wait), with its tensors
    std::lock_guard<std::mutex> l(q->mu);
    q->busy = false;
  }
}

// The inner collective's end, bounded by the collective's own timeout (Comm sets it on each).
void finish(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout) {
  if (!wait_bounded(*work, timeout, /*cpu=*/true)) TORCH_CHECK(false, "Operation timed out!");
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(t.clone());
  return out;
}
Copies pairs(const std::vector<at::Tensor>& to, const std::vector<at::Tensor>& from) {
  Copies c;
  for (size_t i = 0; i < to.size(); ++i) c.emplace_back(to[i], from[i]);
  return c;
}

class RaceDelayBackend final : public c10d::Backend {
 public:
  RaceDelayBackend(c10::intrusive_ptr<c10d::Backend> inner, int rank)
      : Backend(inner->getRank(), inner->getSize()), q_(std::make_shared<Queue>()) {
    q_->inner = std::move(inner);
    q_->rank = rank;
    worker_ = std::thread([q = q_] { work_loop(q); });
  }
  ~RaceDelayBackend() override {
    std::deque<Job> dropped;
    bool idle = false;
    {
      std::lock_guard<std::mutex> l(q_->mu);
      q_->stop = true;
      dropped.swap(q_->jobs);
      idle = !q_->busy;
    }
    q_->cv.notify_all();
    for (auto& job : dropped) {
      job.work->finish_with(std::make_exception_ptr(
          std::runtime_error("fsdp: the race-delay backend was destroyed before this collective ran")));
    }
    // Idle, the worker is about to return; a job still running (its peers gone) is left to end on
    // its own, bounded by its timeout, holding what it needs.
    if (idle) {
      worker_.join();
    } else {
      worker_.detach();
    }
  }
  RaceDelayBackend(const RaceDelayBackend&) = delete;
  RaceDelayBackend& operator=(const RaceDelayBackend&) = delete;

  const std::string getBackendName() const override { return "race-delay over " + q_->inner->getBackendName(); }
  c10::intrusive_ptr<Options> getBackendOptions() override { return q_->inner->getBackendOptions(); }
  c10d::ErrorType getError() override { return q_->inner->getError(); }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& options) override {
    return staged(out, in, options, [](c10d::Backend& b, at::Tensor& o, at::Tensor& i, const auto& opts) {
      return b._allgather_base(o, i, opts);
    });
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& options) override {
    return staged(out, in, options, [](c10d::Backend& b, at::Tensor& o, at::Tensor& i, const auto& opts) {
      return b._reduce_scatter_base(o, i, opts);
    });
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& options) override {
    return in_place(tensors, options, [](c10d::Backend& b, std::vector<at::Tensor>& ts, const auto& opts) {
      return b.allreduce(ts, opts);
    });
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& options) override {
    return in_place(tensors, options, [](c10d::Backend& b, std::vector<at::Tensor>& ts, const auto& opts) {
      return b.broadcast(ts, opts);
    });
  }

 private:
  // An all-gather or reduce-scatter: `call` runs on a snapshot of `in` into a staging output,
  // copied into `out` by the worker. Waited for on the worker (asyncOp), within opts.timeout.
  template <typename Options, typename Call>
  c10::intrusive_ptr<c10d::Work> staged(const at::Tensor& out, const at::Tensor& in, Options opts, Call call) {
    opts.asyncOp = true;
    return enqueue([out, in, opts, call](c10d::Backend& inner) {
      at::Tensor result = at::empty_like(out);
      at::Tensor taken = in.clone();
      finish(call(inner, result, taken, opts), opts.timeout);
      return Copies{{out, result}};
    });
  }
  // An all-reduce or broadcast, in place: `call` runs on snapshots of `tensors`, copied back.
  template <typename Options, typename Call>
  c10::intrusive_ptr<c10d::Work> in_place(const std::vector<at::Tensor>& tensors, Options opts, Call call) {
    opts.asyncOp = true;
    return enqueue([tensors, opts, call](c10d::Backend& inner) {
      std::vector<at::Tensor> taken = clones(tensors);
      finish(call(inner, taken, opts), opts.timeout);
      return pairs(tensors, taken);
    });
  }

  c10::intrusive_ptr<c10d::Work> enqueue(std::function<Copies(c10d::Backend&)> run) {
    auto work = c10::make_intrusive<RaceWork>();
    {
      std::lock_guard<std::mutex> l(q_->mu);
      q_->jobs.push_back(Job{std::move(run), work});
    }
    q_->cv.notify_all();
    return work;
  }

  std::shared_ptr<Queue> q_;
  std::thread worker_;
};

}  // namespace

uint64_t parse_race_delay(const std::string& value, const std::string& what) {
  const bool digits =
      !value.empty() && value.size() <= 18 && value.find_first_not_of("0123456789") == std::string::npos;
  FSDP_CHECK(digits, "fsdp: ", what, "='", value,
             "' is not a race-delay seed: give a whole number of at most 18 digits (the seed of the delays, e.g. ",
             what, "=7), or 0 (off). See docs/usage.md, 'Races made visible'.");
  return std::stoull(value);
}

uint64_t race_delay_seed() {
  RaceState& s = state();
  std::call_once(s.env_read, [&] {
    const char* v = getenv_or_null("FSDP_RACE_DELAY");
    const uint64_t seed = v == nullptr ? 0 : parse_race_delay(v, "FSDP_RACE_DELAY");
    s.seed = seed;
    note_on(seed);
  });
  return s.seed.load(std::memory_order_relaxed);
}

uint64_t set_race_delay_for_testing(uint64_t seed) {
  RaceState& s = state();
  std::call_once(s.env_read, [] {});  // the variable is no longer read
  note_on(seed);
  return s.seed.exchange(seed);
}

int64_t race_delays_applied() {
  return state().applied.load();
}

std::chrono::microseconds next_race_delay(RaceSide side, int rank) {
  if (race_delay_seed() == 0) return std::chrono::microseconds(0);
  return race_delay_draw(side, rank, state().draws[static_cast<size_t>(side)].fetch_add(1));
}

c10::intrusive_ptr<c10d::Backend> race_delay_backend(const c10::intrusive_ptr<c10d::Backend>& inner, int rank) {
  // One wrapper, and so one worker thread, per backend in the process: two workers issuing into one
  // Gloo backend would pair its collectives in an order that thread timing decides.
  RaceState& s = state();
  std::lock_guard<std::mutex> l(s.registry_mu);
  auto& reg = s.registry;
  reg.erase(std::remove_if(reg.begin(), reg.end(), [](const auto& e) { return e.second.expired(); }), reg.end());
  for (auto& [key, weak] : reg) {
    if (key == inner.get()) {
      if (auto live = weak.lock()) return live;
    }
  }
  auto made = c10::make_intrusive<RaceDelayBackend>(inner, rank);
  reg.emplace_back(inner.get(), c10::weak_intrusive_ptr<RaceDelayBackend>(made));
  return made;
}

void read_gathers_before_wait_for_testing(bool on) {
  state().read_before_wait = on;
}
bool reads_gathers_before_wait() {
  return state().read_before_wait.load(std::memory_order_relaxed);
}

}  // namespace fsdp::detail
