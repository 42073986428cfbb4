#include "fsdp/internal/comm.h"
#include "fsdp/internal/subgroups.h"

#include "fsdp/env.h"
#include "fsdp/internal/check.h"

#include "fsdp/internal/flight_recorder.h"
#include "fsdp/internal/foreign_errors.h"
#include "fsdp/internal/monitor.h"
#include "fsdp/internal/nccl_device.h"
#include "fsdp/internal/race_delay.h"

#include <ATen/core/ivalue.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

namespace fsdp::detail {
namespace {

using clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

struct Done {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
};

}  // namespace

// Gloo's works may ignore the timeout given to wait() (its reduce-scatter did), so on CPU the wait
// is ours: on the work's future, which the backend completes with its result or its error.
bool wait_bounded(c10d::Work& work, milliseconds timeout, bool cpu) {
  if (cpu && !work.isCompleted()) {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    try {
      future = work.getFuture();
    } catch (const std::exception&) {
      // A backend without futures: its own bounded wait below.
    }
    if (future) {
      auto done = std::make_shared<Done>();
      future->addCallback([done](c10::ivalue::Future&) {
        std::lock_guard<std::mutex> l(done->mu);
        done->done = true;
        done->cv.notify_all();
      });
      std::unique_lock<std::mutex> l(done->mu);
      if (!done->cv.wait_for(l, timeout, [&] { return done->done; })) return false;
      l.unlock();
      work.wait();  // completed: returns at once, or rethrows the collective's error
      return true;
    }
  }
  return work.wait(timeout);
}

std::string list_ranks(const std::vector<int>& ranks) {
  std::ostringstream os;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks.size() > 12 && i == 6) {
      os << ", ... (" << ranks.size() << " ranks), " << ranks.back();
      break;
    }
    os << (i ? ", " : "") << ranks[i];
  }
  return os.str();
}

void CallLog::add(Call kind, int64_t numel, const std::string& what) {
  ++count;
  hash.add(kind).add(numel).add(what);
  if (names.size() < kNames) names.push_back(what.substr(0, what.find(" (")));
}

std::string CallLog::summary() const {
  std::ostringstream os;
  const size_t n = names.size();
  for (size_t i = 0; i < n; ++i) {
    if (n > 12 && i == 6) {
      os << ", ...";
      i = n - 6;
    }
    os << (i ? ", " : "") << names[i];
  }
  if (count > static_cast<int64_t>(n)) os << ", ... (" << count << " in all)";
  return os.str();
}

Comm::Comm(c10::intrusive_ptr<c10d::ProcessGroup> pg, milliseconds timeout, std::shared_ptr<CommShared> shared,
           GroupInfo group, bool verify)
    : shared_(std::move(shared)),
      pg_(std::move(pg)),
      timeout_(timeout),
      rank_(pg_->getRank()),
      world_size_(pg_->getSize()),
      group_(std::move(group)),
      verify_(verify) {
  FSDP_CHECK(timeout_.count() > 0, "fsdp: the collective timeout must be positive, not ", timeout_.count(), " ms");
  if (group_.global_ranks.empty()) {
    // A group fsdp::new_subgroup made: its members by global rank; otherwise the world's.
    if (auto sub = subgroup_info(pg_.get())) {
      group_.global_ranks = sub->global_ranks;
      group_.world_size = sub->world_size;
      if (group_.name == "world") group_.name = sub->name;
    } else {
      for (int r = 0; r < world_size_; ++r) group_.global_ranks.push_back(r);
    }
  }
  TORCH_INTERNAL_ASSERT(static_cast<int>(group_.global_ranks.size()) == world_size_);
  if (group_.world_size == 0) group_.world_size = world_size_;
  global_rank_ = group_.global_ranks[rank_];
  init_flight_recorder();
  race_delay_seed();  // FSDP_RACE_DELAY read (and a bad value refused) when a model is wrapped
  set_trace_identity(global_rank_, group_.world_size);
  trace_group_ = trace_group(group_.name, group_.global_ranks, group_.background);
}

std::string Comm::where() const {
  std::ostringstream os;
  os << "global rank " << global_rank_ << " of " << group_.world_size;
  if (!group_.mesh.empty()) os << " at " << group_.mesh;
  if (group_.name != "world") {
    os << " (rank " << rank_ << " of " << group_.name << ": global ranks " << list_ranks(group_.global_ranks) << ")";
  }
  return os.str();
}

c10::intrusive_ptr<c10d::Backend> Comm::backend(const at::Tensor& t) const {
  try {
    return pg_->getBackend(t.device().type());
  } catch (const std::exception& e) {
    const std::string& why = nccl_absent_reason();
    FSDP_CHECK(false, "fsdp: ", where(), " has no communication backend for ", t.device(),
               " tensors (Gloo serves CPU, NCCL serves CUDA when a GPU is present): ", error_text(e),
               t.is_cuda() && !why.empty() ? ". This rank has no NCCL backend: " + why : std::string());
  }
}

void Comm::wait(Pending& pending) const {
  if (!pending.in_flight()) return;
  Pending p = std::move(pending);
  pending = Pending{};
  // A profiler that runs (the programs' --profile, or the user's) sees the wait as a span named
  // "fsdp.wait.<op>"; without one this costs a check.
  at::RecordFunction span(at::RecordScope::USER_SCOPE);
  if (span.isActive() && p.op != nullptr) span.before(std::string("fsdp.wait.") + p.op);
  if (p.event) {
    wait_on_event(p);
    return;
  }
  if (p.gloo_cuda) {
    wait_gloo_cuda(p);
    return;
  }
  if (!p.cpu) {
    wait_on_stream(p);
    return;
  }
  wait_on_cpu(p);
}

void Comm::wait_gloo_cuda(Pending& p) const {
  // Gloo copies a CUDA collective's result back on its own streams from its worker thread, and
  // only its Work::wait() makes the current stream wait for that copy; its _reduce_scatter_base
  // is a clone, an all-reduce and a copy of this rank's chunk done inside wait(), on the current
  // stream. So the collective completes here, with the stream it was issued on current, and the
  // event after it is what the compute stream waits for, as with NCCL's side streams.
  if (!p.side || !shared_->streams) {
    wait_on_cpu(p);
    return;
  }
  complete_on_side_stream(*shared_->streams, p.device, *p.side, [&] { wait_on_cpu(p); })->block_current();
}

void Comm::wait_on_cpu(Pending& p) const {
  Activity activity(p.what);  // what this rank's heartbeat tells its peers meanwhile
  const auto start = clock::now();
  const char* const kTimeout = "it did not complete within the timeout (a peer did not take part in time)";
  std::string cause;
  bool timed_out = false;
  try {
    if (!wait_bounded(*p.work, timeout_, p.cpu || p.gloo_cuda)) {
      cause = kTimeout;
      timed_out = true;
    } else if (p.cpu) {
      // Gloo's worker thread still holds the work, and with it the collective's tensors (and
      // staging copies), for a moment after it completes. Waiting for it to let go makes memory
      // the library frees really free when the next step allocates: the bounds in docs/design.md
      // hold in bytes. (NCCL's watchdog keeps its works much longer; CUDA memory is the caching
      // allocator's anyway.)
      const auto until = clock::now() + milliseconds(50);
      while (p.work.use_count() > 1 && clock::now() < until) std::this_thread::yield();
    }
  } catch (const std::exception& e) {
    cause = error_text(e);
    timed_out = recognize_foreign_error(cause) == ForeignError::kTimeout;
    if (timed_out) cause = kTimeout;
  }
  if (cause.empty()) {
    trace_end(p.trace, TraceState::kCompleted);
    return;
  }
  fail(p, cause, std::chrono::duration_cast<milliseconds>(clock::now() - start), timed_out);
}

void Comm::wait_on_stream(Pending& p) const {
  // NCCL's wait(timeout) blocks the CPU until the collective ends (a busy wait), which would undo
  // every overlap: wait() without one makes the current (compute) stream wait for the
  // collective's end event and returns. The backend keeps the tensors alive until then (it
  // records them on its stream); the library keeps its buffers until this wait anyway.
  auto& issued = shared_->device_issued;
  std::string cause;
  const Pending* failed = &p;
  try {
    p.work->wait();
    // A collective that failed (its watchdog timed it out and aborted the communicators) does
    // not throw from wait() in the backend's clean-up mode: look, here and for every earlier one.
    if (p.work->exception()) std::rethrow_exception(p.work->exception());
    for (const auto& q : issued) {
      failed = &q;
      if (q.work->exception()) std::rethrow_exception(q.work->exception());
    }
  } catch (const std::exception& e) {
    cause = error_text(e);
  }
  if (!cause.empty()) fail(*failed, cause, milliseconds(0));
  trace_end(p.trace, TraceState::kEnqueued);  // the CPU does not wait for its end
  // Completed ones are dropped; the rest are kept for the next check, at most kDeviceIssued.
  issued.erase(std::remove_if(issued.begin(), issued.end(), [](const Pending& q) { return q.work->isCompleted(); }),
               issued.end());
  if (issued.size() >= CommShared::kDeviceIssued) issued.erase(issued.begin());
  issued.push_back(std::move(p));
}

void Comm::wait_on_event(Pending& p) const {
  p.event->block_current();
  // No work object to ask: the backend's watchdog still tracks the collective (it does for every
  // collective issued outside a CUDA graph, asyncOp or not), and on a timeout or an NCCL error
  // aborts the communicators and records it in the backend's error state.
  c10d::ErrorType error = c10d::ErrorType::SUCCESS;
  try {
    error = p.backend->getError();
  } catch (const std::exception&) {  // a backend that does not say: its next collective will throw
  }
  if (error == c10d::ErrorType::SUCCESS) {
    trace_end(p.trace, TraceState::kEnqueued);
    return;
  }
  fail(p,
       error == c10d::ErrorType::TIMEOUT
           ? "the backend's watchdog timed out a collective (a peer did not take part in time)"
           : (error == c10d::ErrorType::REMOTE_ERROR ? "the backend's watchdog reported a peer's failure"
                                                     : "the backend's watchdog reported a communication error"),
       milliseconds(0), error == c10d::ErrorType::TIMEOUT);
}

ErrorContext Comm::error_context(const std::string& operation) const {
  return ErrorContext()
      .rank(global_rank_)
      .world_size(group_.world_size)
      .mesh(group_.mesh)
      .operation(operation)
      .group(group_.name == "world" ? "world"
                                    : group_.name + " (global ranks " + list_ranks(group_.global_ranks) + ")");
}

void Comm::fail(const Pending& p, const std::string& cause, milliseconds waited, bool timed_out) const {
  // Its worker threads may still be inside the collective: kept alive until exit, so that
  // neither this error nor destroying the process group waits for them.
  abandon_backend(p.backend);
  trace_end(p.trace, timed_out ? TraceState::kTimedOut : TraceState::kFailed);
  note_failure(p.what);
  // Every rank of the job, not only this group's: under hybrid sharding a rank of another group
  // that died is often why this group's collective failed.
  std::vector<int> everyone;
  everyone.reserve(static_cast<size_t>(group_.world_size));
  for (int r = 0; r < group_.world_size; ++r) everyone.push_back(r);
  const PeerDiagnosis peers = diagnose_peers(everyone, global_rank_);
  // This rank's last collectives and what it learned of its peers, for fsdp-trace; a dump that
  // cannot be written is mentioned, never in the way of the error itself.
  const DumpResult dump = dump_flight_record((timed_out ? "timeout in " : "failure in ") + p.what, peers);
  std::string recorder;
  if (!dump.path.empty()) {
    recorder = "\nFlight recorder: this rank's last collectives are in " + dump.path + "; `fsdp-trace " + trace_dir() +
               "` reads every rank's file there and names the rank that is behind.";
  } else if (!dump.error.empty()) {
    recorder = "\nFlight recorder: this rank's file could not be written (" + dump.error +
               "); set FSDP_FLIGHT_RECORDER_DIR to a writable directory.";
  }
  std::string first_line = cause.substr(0, cause.find('\n'));
  const std::string group = group_.name == "world" ? " (group: all " + std::to_string(world_size_) + " ranks)" : "";
  FSDP_CHECK_IN(error_context(p.what).peer(peers.peer), false, "fsdp: ", p.what, " failed on ", where(), group,
                " after ", waited.count(), " ms (timeout ", timeout_.count(), " ms): ", first_line,
                peers.text.empty() ? "" : "\n", peers.text,
                "\nThe ranks no longer agree on which collective comes next, so this model cannot be used again: exit "
                "this process with a non-zero status and restart the job from its last checkpoint (torchrun "
                "--max-restarts, or the scheduler's requeue). See docs/usage.md, 'When a collective fails'.",
                recorder);
}

Pending Comm::launch(const char* op, const std::string& what, const at::Tensor& t, const Start& start,
                     std::optional<SideStream> side, bool point_to_point) const {
  Pending p{nullptr, what, t.is_cpu(), backend(t)};
  p.op = op;
  if (race_delay_seed() != 0) race_delay_issue(p, t, /*wrap=*/!point_to_point);
  p.gloo_cuda = t.is_cuda() && p.backend->getBackendName() == "gloo";
  p.device = t.device();
  p.trace =
      trace_issue(trace_group_, op, what, t.numel(), static_cast<int64_t>(t.nbytes()), t.scalar_type(), t.device());
  try {
    if (p.gloo_cuda && side && shared_->side_streams && shared_->streams) {
      p.side = side;
      issue_on_side_stream(*shared_->streams, t.device(), *side, [&] {
        if (race_delay_seed() != 0) sleep_current_stream(t.device(), next_race_delay(RaceSide::kComm, global_rank_));
        p.work = start(*p.backend, /*async_op=*/true);
      });
    } else if (side && t.is_cuda() && shared_->side_streams && shared_->streams) {
      // FSDP2's way: asyncOp false runs the collective on the stream current at the call, here
      // the side stream, and returns no work; the event after it is what the consumer waits for.
      p.event = on_side_stream(*shared_->streams, t.device(), *side, [&] {
        // The race switch's delay of the communication side: on the side stream, before the collective.
        if (race_delay_seed() != 0) sleep_current_stream(t.device(), next_race_delay(RaceSide::kComm, global_rank_));
        p.work = start(*p.backend, /*async_op=*/false);
      });
    } else {
      // On a GPU without side streams, the race switch's delay of the communication side is on the
      // current stream, before the collective (NCCL's stream and Gloo wait for it).
      if (t.is_cuda() && race_delay_seed() != 0) {
        sleep_current_stream(t.device(), next_race_delay(RaceSide::kComm, global_rank_));
      }
      p.work = start(*p.backend, /*async_op=*/true);
    }
  } catch (const std::exception& e) {
    fail(p, error_text(e), milliseconds(0));
  }
  return p;
}

void Comm::race_delay_issue(Pending& p, const at::Tensor& t, bool wrap) const {
  if (!t.is_cpu() || is_fake_backend(*p.backend)) return;
  // Before the issue (the ranks arrive at different times), never between issue and wait.
  std::this_thread::sleep_for(next_race_delay(RaceSide::kIssue, global_rank_));
  if (!wrap) return;
  auto& wrapped = shared_->race_backends;
  auto it = std::find_if(wrapped.begin(), wrapped.end(), [&](const auto& w) { return w.first == p.backend.get(); });
  if (it == wrapped.end()) {
    // In the Gloo testing mode one Gloo backend serves CUDA tensors too, issued to it directly: a
    // wrapper's thread would reorder its CPU collectives against those. It stays unwrapped; its
    // delays are the issue's and the GPU's sleep kernels.
    bool serves_cuda = false;
    for (const auto& d : pg_->getDeviceTypes()) {
      serves_cuda = serves_cuda || (d.is_cuda() && pg_->getBackend(c10::DeviceType::CUDA).get() == p.backend.get());
    }
    wrapped.emplace_back(p.backend.get(), serves_cuda ? p.backend : race_delay_backend(p.backend, global_rank_));
    it = std::prev(wrapped.end());
  }
  p.backend = it->second;
}

std::unique_ptr<StreamEvent> Comm::on_side(const at::Device& device, SideStream side,
                                           const std::function<void()>& fn) const {
  if (device.is_cuda() && shared_->side_streams && shared_->streams) {
    return on_side_stream(*shared_->streams, device, side, fn);
  }
  fn();
  return nullptr;
}

void Comm::record(Call op, int64_t numel, const std::string& what) const {
  switch (op) {
    case Call::kAllGather:
      ++stats().all_gathers;
      stats().elements += numel;
      break;
    case Call::kReduceScatter:
      ++stats().reduce_scatters;
      stats().elements += numel;
      break;
    case Call::kAllReduce:
      ++stats().all_reduces;
      stats().elements += 2 * numel;
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "Comm::record of a call that is not a counted collective");
  }
  log().add(op, numel, what);
}

void Comm::verify_call(Call op, int64_t numel, const at::Tensor& t, const std::string& what, int64_t extra) {
  if (!verify_) return;
  agree(op, Fingerprint().add(numel).add(static_cast<int64_t>(t.scalar_type())).add(what).add(extra).value(), what);
}

bool Comm::done_alone_or_checked(Call op, int64_t numel, at::Tensor& out, const at::Tensor& in,
                                 const std::string& what) {
  record(op, numel, what);
  if (world_size_ == 1 && !shared_->launch_alone) {  // alone: the collective is a copy
    out.copy_(in.reshape(out.sizes()));
    return true;
  }
  verify_call(op, numel, in, what);
  return false;
}

Pending Comm::all_gather_async(at::Tensor& out, at::Tensor& in, const std::string& what) {
  TORCH_INTERNAL_ASSERT(out.numel() == in.numel() * world_size_);
  if (done_alone_or_checked(Call::kAllGather, out.numel(), out, in, what)) return {nullptr, what};
  return launch(
      "all-gather", what, in,
      [&](c10d::Backend& b, bool async_op) {
        c10d::AllgatherOptions opts;
        opts.timeout = timeout_;  // Gloo's own bound inside its worker thread
        opts.asyncOp = async_op;
        return b._allgather_base(out, in, opts);
      },
      SideStream::kAllGather);
}

void Comm::all_gather(at::Tensor& out, at::Tensor& in, const std::string& what) {
  Pending p = all_gather_async(out, in, what);
  wait(p);
}

Pending Comm::reduce_scatter_sum_async(at::Tensor& out, at::Tensor& in, const std::string& what) {
  TORCH_INTERNAL_ASSERT(in.numel() == out.numel() * world_size_);
  if (done_alone_or_checked(Call::kReduceScatter, in.numel(), out, in, what)) return {nullptr, what};
  return launch(
      "reduce-scatter", what, in,
      [&](c10d::Backend& b, bool async_op) {
        c10d::ReduceScatterOptions opts;
        opts.reduceOp = c10d::ReduceOp::SUM;
        opts.timeout = timeout_;
        opts.asyncOp = async_op;
        return b._reduce_scatter_base(out, in, opts);
      },
      SideStream::kReduce);
}

Pending Comm::all_reduce_async(at::Tensor& t, c10d::ReduceOp op, const std::string& what) {
  record(Call::kAllReduce, t.numel(), what);
  if (group_.across_replicas) stats().replica_bytes += 2 * t.numel() * static_cast<int64_t>(t.element_size());
  if (world_size_ == 1 && !shared_->launch_alone) return {nullptr, what};
  verify_call(Call::kAllReduce, t.numel(), t, what, static_cast<int64_t>(op.op_));
  return launch(
      "all-reduce", what, t,
      [&](c10d::Backend& b, bool async_op) {
        std::vector<at::Tensor> ts{t};
        c10d::AllreduceOptions opts;
        opts.reduceOp = op;
        opts.timeout = timeout_;
        opts.asyncOp = async_op;
        return b.allreduce(ts, opts);
      },
      SideStream::kReduce);
}

uint64_t Comm::reduction_fingerprint(const at::Tensor& t, const c10d::ReduceOp& op, const std::string& what) {
  return Fingerprint()
      .add(what)
      .add(t.numel())
      .add(static_cast<int64_t>(t.scalar_type()))
      .add(static_cast<int64_t>(op.op_))
      .value();
}

void Comm::all_reduce(at::Tensor& t, c10d::ReduceOp op, const std::string& what) {
  Pending p = all_reduce_async(t, std::move(op), what);
  wait(p);
}

void Comm::broadcast(const at::Tensor& t, int root, const std::string& what) {
  ++stats().broadcasts;
  if (group_.across_replicas) stats().replica_bytes += t.numel() * static_cast<int64_t>(t.element_size());
  log().add(Call::kBroadcast, t.numel(), what);
  if (world_size_ == 1) return;
  verify_call(Call::kBroadcast, t.numel(), t, what);
  // The backend needs contiguous memory: a strided tensor goes through a copy, written back.
  at::Tensor buf = t.is_contiguous() ? t : t.contiguous();
  Pending p = launch("broadcast", what, buf, [&](c10d::Backend& b, bool /*async_op*/) {
    std::vector<at::Tensor> ts{buf};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = timeout_;
    return b.broadcast(ts, opts);
  });
  wait(p);
  if (!buf.is_same(t)) t.copy_(buf);
}

Pending Comm::send_async(const at::Tensor& t, int peer, int tag, const std::string& what, bool header) {
  TORCH_INTERNAL_ASSERT(t.is_contiguous() && peer >= 0 && peer < world_size_ && peer != rank_);
  ++stats().sends;
  if (!header) stats().p2p_bytes += static_cast<int64_t>(t.nbytes());
  return launch(
      "send", what, t,
      [&](c10d::Backend& b, bool /*async_op*/) {
        std::vector<at::Tensor> ts{t};
        return b.send(ts, peer, tag);
      },
      std::nullopt, /*point_to_point=*/true);
}

Pending Comm::recv_async(const at::Tensor& t, int peer, int tag, const std::string& what, bool header) {
  TORCH_INTERNAL_ASSERT(t.is_contiguous() && peer >= 0 && peer < world_size_ && peer != rank_);
  ++stats().recvs;
  if (!header) stats().p2p_bytes += static_cast<int64_t>(t.nbytes());
  return launch(
      "recv", what, t,
      [&](c10d::Backend& b, bool /*async_op*/) {
        std::vector<at::Tensor> ts{t};
        return b.recv(ts, peer, tag);
      },
      std::nullopt, /*point_to_point=*/true);
}

std::chrono::milliseconds group_timeout(c10d::ProcessGroup& pg) {
  try {
    return pg.getBackend(c10::DeviceType::CPU)->getBackendOptions()->timeout;
  } catch (const std::exception&) {
    return default_timeout();  // a backend that does not say
  }
}

}  // namespace fsdp::detail
