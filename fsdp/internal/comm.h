// The communication context: the collectives the library issues, their counts, one bounded wait
// for every one of them, the one cross-rank agreement ("every rank of this group is at the same
// call") and the one exchange of strings between ranks, and errors that name the rank, the
// operation, the unit, the group and the peer. The sharding core, the model check, fsdp::all_reduce,
// clipping and the checkpoints all go through it. Internal to the library.
#pragma once

#include "fsdp/comm_stats.h"
#include "fsdp/error.h"
#include "fsdp/export.h"
#include "fsdp/internal/calls.h"
#include "fsdp/internal/cuda_backend.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

namespace detail {

struct TraceGroup;  // fsdp/internal/flight_recorder.h

/// The members of a Comm's group, for messages: its name and their global ranks (group-rank order).
struct GroupInfo {
  std::string name = "world";
  std::vector<int> global_ranks;  ///< empty: the group is the world, group rank = global rank
  int world_size = 0;             ///< of the job (0: the group's size)
  /// A background thread's group (an AsyncSaver's): its collectives are in the flight recorder's
  /// ring, but the heartbeat keeps the last one of the training's groups, where a hang is.
  bool background = false;
  /// A group of a DeviceMesh: this rank's coordinates and the mesh's shape, "(dp_shard 1, tp 0) of
  /// mesh (dp_shard 2, tp 2)", named in errors beside the global rank. Empty otherwise.
  std::string mesh;
  /// A group of ranks that hold the same shard in different replicas (hybrid's replicate group, a
  /// mesh's dp_replicate): its traffic is also counted in CommStats::replica_bytes.
  bool across_replicas = false;
};

/// The collectives a model issued since its last cross-rank check, as a count and a hash of their
/// kinds, sizes and descriptions (operation and unit): compared between ranks at the next check,
/// so that ranks whose sequences differed with equal sizes (units run in another order) are caught
/// before the optimizer uses what they computed.
struct FSDP_API CallLog {
  int64_t count = 0;
  Fingerprint hash;
  /// The first collectives, by operation and unit ("all-gather of unit 'h.1'"), for messages.
  std::vector<std::string> names;
  static constexpr size_t kNames = 64;
  void add(Call kind, int64_t numel, const std::string& what);
  /// "all-gather of unit '<root>', all-gather of unit 'a', ..." (the first and last few).
  std::string summary() const;
  void reset() { *this = CallLog{}; }
};

/// A collective in flight: wait() before touching its tensors.
struct Pending {
  c10::intrusive_ptr<c10d::Work> work;  // null when there was nothing to wait for (one rank)
  std::string what;
  bool cpu = false;  // Gloo: wait() also waits for the worker thread to drop the work
  c10::intrusive_ptr<c10d::Backend> backend;
  /// CUDA, on a side stream (CommShared::side_streams): the collective's end, which the current
  /// stream waits for. The backend returns no work then.
  std::shared_ptr<StreamEvent> event;
  int64_t trace = -1;  ///< its flight-recorder entry (fsdp/internal/flight_recorder.h), -1: none
  /// Gloo on CUDA tensors (the testing mode of several ranks on one GPU): complete only through
  /// the work's wait(), run with the side stream `side` current when it was issued on one.
  bool gloo_cuda = false;
  std::optional<SideStream> side;
  c10::Device device{c10::kCPU};
  const char* op = nullptr;  // "all-gather", ...: its wait's name in a profile ("fsdp.wait.all-gather")
  bool in_flight() const { return work || event; }
};

/// What the Comms of one model share: statistics, the call log, and the CUDA collectives whose
/// completion the CPU never waited for (see Comm::wait): checked for an error at every later wait.
struct CommShared {
  CommStats stats;
  CallLog log;
  std::vector<Pending> device_issued;
  static constexpr size_t kDeviceIssued = 64;  ///< kept at most; the oldest are completed long before
  /// CUDA: all-gathers on one side stream, reductions on another (FullyShardOptions::comm_streams);
  /// otherwise every collective on the backend's own stream.
  bool side_streams = !nccl_blocking_wait();
  std::shared_ptr<SideStreams> streams = make_side_streams();
  /// Testing: all-gathers, reduce-scatters and all-reduces over a one-rank group are launched on
  /// the backend too (normally a copy), so that a single device exercises its streams and waits.
  bool launch_alone = false;
  /// FSDP_RACE_DELAY (fsdp/internal/race_delay.h): each CPU backend's wrapper, made at its first
  /// collective, keyed by the backend it wraps (kept alive by the process group).
  std::vector<std::pair<const c10d::Backend*, c10::intrusive_ptr<c10d::Backend>>> race_backends;
};

class FSDP_API Comm {
 public:
  /// `shared` may be shared between the Comms of one model (hybrid sharding's groups). With
  /// `verify`, every collective is preceded by a cross-rank check of its fingerprint.
  Comm(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::chrono::milliseconds timeout,
       std::shared_ptr<CommShared> shared = std::make_shared<CommShared>(), GroupInfo group = {}, bool verify = false);

  /// This rank's place in the group.
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  /// This rank in the job, and the job's size.
  int global_rank() const { return global_rank_; }
  int global_world_size() const { return group_.world_size; }
  /// The global ranks of the group's members, in group-rank order.
  const std::vector<int>& global_ranks() const { return group_.global_ranks; }
  /// "global rank 1 of 4", or "global rank 3 of 4 (rank 1 of hybrid shard group 1: global ranks 2, 3)";
  /// over a mesh's group, "global rank 3 of 4 at (dp_shard 1, tp 1) of mesh (dp_shard 2, tp 2) (rank
  /// 1 of tp group (dp_shard 1): global ranks 2, 3)".
  std::string where() const;
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return pg_; }

  /// out[r * in.numel() + i] = in_r[i] for every rank r (rank-major).
  void all_gather(at::Tensor& out, at::Tensor& in, const std::string& what);
  /// The same, returning at once; `out` and `in` must stay alive and untouched until wait().
  Pending all_gather_async(at::Tensor& out, at::Tensor& in, const std::string& what);
  /// out = (sum over ranks of in)[rank * out.numel(), (rank + 1) * out.numel()).
  /// Gloo may implement this as an all-reduce; SUM is used because some versions turn AVG into SUM.
  Pending reduce_scatter_sum_async(at::Tensor& out, at::Tensor& in, const std::string& what);
  /// Counts and logs a collective as issued (`op`: kAllGather, kReduceScatter or kAllReduce;
  /// `numel`: the all-gather's output, the reduce-scatter's input, the all-reduce's tensor). The
  /// collectives below do this themselves; a unit that skips one over a one-rank group (its data
  /// already in place, see Unit::gather) calls it, so that the statistics and the call log are the
  /// algorithm's at every group size.
  void record(Call op, int64_t numel, const std::string& what) const;
  /// Waits for a pending collective, at most the timeout whatever the backend does; throws naming
  /// the operation, the rank, the group and what is known of the peers on failure. On CUDA (NCCL)
  /// the CPU does not wait: the current stream is made to wait for the collective, and the
  /// timeout is the backend's watchdog's (created with this timeout, set to abort the
  /// communicators without ending the process); a collective it failed is reported here, by the
  /// first wait after the failure is known, with the usual message.
  void wait(Pending& pending) const;
  void all_reduce(at::Tensor& t, c10d::ReduceOp op, const std::string& what);
  /// What the agreement before an "agree, then all-reduce" compares, in both places it is done
  /// (fsdp::all_reduce over a group; the door's all_reduce, which agrees through the model's call
  /// log): `what` and the tensor's element count, dtype and op, so that ranks about to reduce
  /// different tensors stop with an error naming both instead of pairing them.
  static uint64_t reduction_fingerprint(const at::Tensor& t, const c10d::ReduceOp& op, const std::string& what);
  Pending all_reduce_async(at::Tensor& t, c10d::ReduceOp op, const std::string& what);
  /// Broadcasts `t` in place from group rank `root` (a strided tensor goes through a copy).
  void broadcast(const at::Tensor& t, int root, const std::string& what);
  /// Point to point (fsdp::pp's stages): sends contiguous `t` to group rank `peer` under `tag`,
  /// returning at once (the transfer completes when the peer receives it; `t` stays alive and
  /// untouched until wait()). recv_async receives group rank `peer`'s send of the same tag into
  /// contiguous `t`, of the sent size. Counted in CommStats (sends or recvs, p2p_bytes unless
  /// `header`: a transfer's shape header), not in the call log (a stage's transfers are not its
  /// peers'), flight-recorded as "send" / "recv" with `what`; wait() is bounded by the timeout.
  Pending send_async(const at::Tensor& t, int peer, int tag, const std::string& what, bool header = false);
  Pending recv_async(const at::Tensor& t, int peer, int tag, const std::string& what, bool header = false);
  /// CUDA with side streams (as the collectives): runs `fn` with side stream `side` of `device`
  /// current, after what the current stream has queued, and returns the event after it, which the
  /// consumer's stream must wait for (StreamEvent::block_current). Elsewhere runs `fn` on the
  /// current stream and returns null. CPU offload's copies between host and device use it.
  std::unique_ptr<StreamEvent> on_side(const at::Device& device, SideStream side,
                                       const std::function<void()>& fn) const;

  /// The one cross-rank agreement: every rank of the group is at call `call` with the same
  /// `payload` (a Fingerprint of what the call depends on), or every rank throws the same
  /// fsdp::Error ("the ranks took different paths"), naming what each rank was doing: its `what`
  /// followed by `details()`, put into words and exchanged only when the calls differ. `vote`: a
  /// number each rank adds, not compared (a phase failed here, a busy saver); every rank's comes
  /// back, in group-rank order. One all-gather of four numbers per rank; nothing when alone. Its
  /// wait is every collective's (bounded by the timeout). `explain`, when the ranks are all at
  /// `call` and only their payloads differ, gets every rank's description and throws the error
  /// that says how they differ, as its caller's, instead of the list (the model check names the
  /// first differing parameter); if it returns, the list follows.
  using Details = std::function<std::string()>;
  using Explain = std::function<void(const std::vector<std::string>& descriptions)>;
  std::vector<int64_t> agree(Call call, uint64_t payload, const std::string& what, const Details& details = {},
                             int64_t vote = 0, const Explain& explain = {});
  /// The one exchange of strings: every rank's `text`, in group-rank order, on every rank, or with
  /// `root` >= 0 on that rank only (empty elsewhere, and only it receives them all). Two
  /// collectives: the lengths, then the texts padded to the longest. Not counted in the statistics
  /// (it serves checks and checkpoints, not training); `what` names it in errors.
  std::vector<std::string> exchange_strings(const std::string& text, const std::string& what, int root = -1);
  /// What an error raised here carries: this rank (global) of the job's ranks, `operation`, the
  /// group, the mesh (fsdp/error.h).
  ErrorContext error_context(const std::string& operation = "") const;
  /// The same for an error raised by the library call `api` (operation and api both `api`): its
  /// message begins "<api> (rank r of N): " (fsdp/internal/check.h, error_caller).
  ErrorContext error_in(const std::string& api) const { return error_context(api).api(api); }

  /// The same group without the check before every collective: for the model check, which must
  /// pair up on every rank even when the ranks disagree about `verify` itself.
  Comm unverified() const {
    Comm c = *this;
    c.verify_ = false;
    return c;
  }

  CommStats& stats() const { return shared_->stats; }
  CallLog& log() const { return shared_->log; }
  const std::shared_ptr<CommShared>& shared() const { return shared_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  bool verify() const { return verify_; }

 private:
  c10::intrusive_ptr<c10d::Backend> backend(const at::Tensor& t) const;
  /// What an all-gather or reduce-scatter does first: counts it; alone, copies `in` to `out` and
  /// returns true (nothing to launch); otherwise checks the call across ranks when verifying.
  bool done_alone_or_checked(Call op, int64_t numel, at::Tensor& out, const at::Tensor& in, const std::string& what);
  /// Starts a collective on `t`'s backend with `start(backend, async_op)`; a backend that throws
  /// fails like a wait. A CUDA tensor's collective goes to side stream `side` when given and the
  /// model uses side streams, started with async_op false (on the stream current then).
  using Start = std::function<c10::intrusive_ptr<c10d::Work>(c10d::Backend&, bool async_op)>;
  /// `op` names the collective in the flight recorder ("all-gather", "agreement", ...).
  Pending launch(const char* op, const std::string& what, const at::Tensor& t, const Start& start,
                 std::optional<SideStream> side = std::nullopt, bool point_to_point = false) const;
  /// `timed_out`: the caller saw the timeout run out (recorded as such, and named in the dump).
  [[noreturn]] void fail(const Pending& p, const std::string& cause, std::chrono::milliseconds waited,
                         bool timed_out = false) const;
  /// Before a collective under verify_collectives: the same call on every rank.
  void verify_call(Call op, int64_t numel, const at::Tensor& t, const std::string& what, int64_t extra = 0);
  /// An all-gather of `in` into `out` on the CPU backend (agreements, exchanges): not counted in
  /// the statistics; recorded in the flight recorder as `op`.
  void gather_small(at::Tensor& out, at::Tensor& in, const char* op, const std::string& what) const;
  /// The race switch at an issue: on CPU the seeded delay before it, and `p`'s backend replaced
  /// by its race-delay wrapper (not for a point-to-point transfer, which the wrapper lacks).
  void race_delay_issue(Pending& p, const at::Tensor& t, bool wrap = true) const;
  /// wait() of a collective the CPU waits for (Gloo's), at most the timeout.
  void wait_on_cpu(Pending& p) const;
  /// wait() of Gloo's CUDA collective: wait_on_cpu with its side stream current, then the current
  /// stream waits for the event recorded after it.
  void wait_gloo_cuda(Pending& p) const;
  /// wait() of a CUDA collective: the stream waits, the CPU checks for known failures.
  void wait_on_stream(Pending& p) const;
  /// wait() of a collective on a side stream: the current stream waits for its event; the
  /// backend's error state (its watchdog's finding) is checked.
  void wait_on_event(Pending& p) const;

  std::shared_ptr<CommShared> shared_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::chrono::milliseconds timeout_;
  int rank_;
  int world_size_;
  GroupInfo group_;
  int global_rank_;
  bool verify_;
  std::shared_ptr<TraceGroup> trace_group_;  // this group's count in the flight recorder
};

/// Waits for `work` at most `timeout` (false: it did not complete), rethrowing its error; on CPU
/// (`cpu`) through the work's future, which Gloo completes even where its wait() ignores a timeout.
bool wait_bounded(c10d::Work& work, std::chrono::milliseconds timeout, bool cpu);

/// Whether `backend` is the fake backend of fsdp::make_fake_process_group (a simulated rank).
FSDP_API bool is_fake_backend(const c10d::Backend& backend);

/// The timeout `pg`'s CPU backend was created with (init_process_group's), else default_timeout().
FSDP_API std::chrono::milliseconds group_timeout(c10d::ProcessGroup& pg);

/// "0, 1, 2", or for many ranks the first six, the count and the last.
FSDP_API std::string list_ranks(const std::vector<int>& ranks);

using fsdp::error_text;

}  // namespace detail
}  // namespace fsdp
