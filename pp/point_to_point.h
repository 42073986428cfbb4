// fsdp::pp::PointToPoint: a pipeline's transfers, activations forward to the next stage and their
// gradients backward to the one before, over the "pp" dimension of a DeviceMesh.
//
//   fsdp::DeviceMesh mesh(world, {{"pp", 2}, {"dp_shard", 2}});
//   fsdp::pp::PointToPoint p2p(mesh);     // this rank and the ranks of its (dp, tp) place in the other stages
//   using fsdp::pp::Payload;
//   auto sent = p2p.send(h, /*peer=*/1, {Payload::kActivation, /*from=*/0, /*to=*/1, /*microbatch=*/3});
//   ... compute ...
//   p2p.wait(sent);                        // before `h` is changed or freed
//   auto g = p2p.recv(/*peer=*/1, {Payload::kGradient, 1, 0, 3});
//
// Each transfer is two messages: a small header (the tensor's dtype and shape, and what it carries)
// and the data, so microbatches may differ in shape (sequence lengths) and the receiver allocates
// what arrives. A send returns at once and completes when the peer receives it; a receive waits for
// the header, then for the data. Every wait is bounded by the mesh's timeout; a transfer whose peer
// does not take part in time fails with an fsdp::Error naming the operation ("recv of microbatch
// 3's activations from stage 0 to stage 1"), this rank, its mesh coordinates and the peer, and is
// in the flight recorder under that name (fsdp-trace shows the stage and microbatch a hang waits
// in). Each (payload, sending stage, microbatch) travels under its own tag, so a receive never
// pairs with another transfer's send: an order that does not match fails within the timeout rather
// than mixing data. Transfers are counted in comm_stats(): sends, recvs and p2p_bytes.
//
// CUDA tensors are staged through host memory and sent over the CPU backend (Gloo), which pairs a
// receive with its send by tag. NCCL pairs by issue order alone, and a rank's send to a peer can
// wait behind that peer's send to it (1F1B's crossing transfers): a direct NCCL path waits for a
// coalesced exchange proven on GPUs.
#pragma once

#include "fsdp/comm_stats.h"
#include "fsdp/device_mesh.h"
#include "fsdp/export.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>

FSDP_PUBLIC_BEGIN

namespace fsdp {
namespace detail {
class Comm;
struct FSDP_HIDDEN TransferState;
}  // namespace detail

namespace pp {

enum class Payload { kActivation, kGradient };

/// What one transfer carries: activations forward or gradients backward, between stages `from`
/// and `to`, of microbatch `microbatch`. Both sides describe it alike.
struct Message {
  Payload payload = Payload::kActivation;
  int64_t from = 0, to = 1;
  int64_t microbatch = 0;
  /// "microbatch 3's activations from stage 0 to stage 1".
  std::string text() const;
};

/// A send in flight (PointToPoint::send); PointToPoint::wait completes it. Destroyed unwaited, it
/// is abandoned: the peer's receive then fails within its timeout.
class Transfer {
 public:
  Transfer();
  ~Transfer();
  Transfer(Transfer&&) noexcept;
  Transfer& operator=(Transfer&&) noexcept;
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;
  /// Whether it still needs its wait.
  bool pending() const;

 private:
  friend class PointToPoint;
  std::unique_ptr<detail::TransferState> state_;
};

class PointToPoint {
 public:
  /// Over `mesh`'s "pp" group: this rank's pipeline rank is its pp coordinate, its peers the ranks
  /// at the same (dp, tp) coordinates in the other stages. A mesh without pp is a one-rank pipeline.
  explicit PointToPoint(const DeviceMesh& mesh);
  ~PointToPoint();
  PointToPoint(const PointToPoint&) = default;
  PointToPoint& operator=(const PointToPoint&) = default;

  /// This rank's pipeline rank, and the pipeline's ranks.
  int rank() const;
  int size() const;
  /// How errors name this rank: "global rank 2 of 4 at (pp 1, dp_shard 0) of mesh (pp 2, dp_shard 2)".
  std::string where() const;

  /// Starts sending `t` (any layout: a non-contiguous tensor is copied) to pipeline rank `peer`.
  /// Wait for it before changing `t` in place. Throws std::invalid_argument for a peer outside the
  /// pipeline or this rank itself, and for a message whose stage or microbatch the tags cannot hold
  /// (stages below 512, microbatches below 2^20).
  Transfer send(const at::Tensor& t, int64_t peer, const Message& m);
  /// Waits, at most the timeout, for a send to complete (the peer received it); an fsdp::Error
  /// otherwise. A waited or empty transfer returns at once.
  void wait(Transfer& transfer);
  /// Receives pipeline rank `peer`'s send of `m`, onto `device`: its header, then its data, each
  /// wait bounded by the timeout. An fsdp::Error if the header is not one of a transfer (another
  /// program on the port) or names another message.
  at::Tensor recv(int64_t peer, const Message& m, const at::Device& device = at::kCPU);

  /// What this object (and its copies) sent and received since it was made or reset.
  const CommStats& comm_stats() const;
  void reset_comm_stats();

 private:
  std::shared_ptr<detail::Comm> comm_;
};

}  // namespace pp
}  // namespace fsdp

FSDP_PUBLIC_END
