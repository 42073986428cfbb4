#include "pp/point_to_point.h"

#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"

#include <ATen/ops/empty.h>

#include <stdexcept>
#include <vector>

namespace fsdp {
namespace detail {

/// A send in flight: its header and its data, and the tensors they read (kept alive until the wait).
struct FSDP_HIDDEN TransferState {
  Pending header, data;
  at::Tensor header_tensor, data_tensor;
};

}  // namespace detail

namespace pp {
namespace {

// The header: a magic number (a receive that pairs with something else fails clearly), the dtype,
// what is carried (payload, stages, microbatch), then the shape.
constexpr int64_t kMagic = 0x70705f7032703031;  // "pp_p2p01"
constexpr int64_t kMaxDims = 8;
constexpr int64_t kFixed = 7;  // magic, dtype, payload, from, to, microbatch, ndim
constexpr int64_t kHeader = kFixed + kMaxDims;
constexpr int64_t kMaxStages = 512, kMaxMicrobatches = int64_t{1} << 20;

// One tag per (payload, sending stage, microbatch), the header's even and the data's odd: Gloo
// pairs a receive with the send of the same peer and tag only.
int tag_of(const Message& m, bool data) {
  const int64_t t =
      ((m.microbatch * kMaxStages + m.from) * 2 + (m.payload == Payload::kGradient ? 1 : 0)) * 2 + (data ? 1 : 0);
  return static_cast<int>(t);
}

void check_message(const Message& m, int64_t peer, int size, int rank, const char* op) {
  if (peer < 0 || peer >= size || peer == rank) {
    throw std::invalid_argument(std::string("fsdp::pp::PointToPoint::") + op + " of " + m.text() + ": peer " +
                                std::to_string(peer) + " is not another rank of the pipeline's " +
                                std::to_string(size) + " (this is pipeline rank " + std::to_string(rank) + ")");
  }
  if (m.from < 0 || m.from >= kMaxStages || m.to < 0 || m.to >= kMaxStages || m.microbatch < 0 ||
      m.microbatch >= kMaxMicrobatches) {
    throw std::invalid_argument(std::string("fsdp::pp::PointToPoint::") + op + " of " + m.text() +
                                ": stages must be in [0, 512) and microbatches in [0, 2^20)");
  }
}

}  // namespace

std::string Message::text() const {
  return "microbatch " + std::to_string(microbatch) + "'s " +
         (payload == Payload::kActivation ? "activations" : "gradients") + " from stage " + std::to_string(from) +
         " to stage " + std::to_string(to);
}

Transfer::Transfer() = default;
Transfer::~Transfer() = default;
Transfer::Transfer(Transfer&&) noexcept = default;
Transfer& Transfer::operator=(Transfer&&) noexcept = default;

bool Transfer::pending() const {
  return state_ && (state_->header.in_flight() || state_->data.in_flight());
}

PointToPoint::PointToPoint(const DeviceMesh& mesh) : comm_(detail::mesh_group(mesh, kPipeDim, /*verify=*/false)) {}

PointToPoint::~PointToPoint() = default;

int PointToPoint::rank() const {
  return comm_->rank();
}

int PointToPoint::size() const {
  return comm_->world_size();
}

std::string PointToPoint::where() const {
  return comm_->where();
}

Transfer PointToPoint::send(const at::Tensor& t, int64_t peer, const Message& m) {
  check_message(m, peer, size(), rank(), "send");
  FSDP_CHECK_IN(comm_->error_context("fsdp::pp::PointToPoint::send"), t.defined() && t.dim() <= kMaxDims,
                "fsdp::pp::PointToPoint::send of ", m.text(), " on ", where(), ": the tensor is ",
                t.defined() ? "of " + std::to_string(t.dim()) + " dimensions (at most 8)" : "undefined");
  Transfer out;
  out.state_ = std::make_unique<detail::TransferState>();
  auto& s = *out.state_;
  s.header_tensor = at::zeros({kHeader}, at::kLong);
  auto* h = s.header_tensor.data_ptr<int64_t>();
  h[0] = kMagic;
  h[1] = static_cast<int64_t>(t.scalar_type());
  h[2] = m.payload == Payload::kGradient ? 1 : 0;
  h[3] = m.from;
  h[4] = m.to;
  h[5] = m.microbatch;
  h[6] = t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) h[kFixed + d] = t.size(d);
  // What the backend sends: contiguous, and on the host where Gloo serves a CUDA tensor.
  // A CUDA tensor goes through host memory, over the CPU backend (Gloo), which pairs by tag: NCCL
  // would pair by issue order alone, and its send to a peer can wait behind that peer's send to
  // it (1F1B's crossing transfers), so it waits for a GPU run that proves a coalesced exchange.
  s.data_tensor = t.is_cuda() ? t.detach().to(at::kCPU).contiguous() : t.detach().contiguous();
  const std::string what = "send of " + m.text();
  const int dst = static_cast<int>(peer);
  s.header = comm_->send_async(s.header_tensor, dst, tag_of(m, false), what + " (its header)", /*header=*/true);
  s.data = comm_->send_async(s.data_tensor, dst, tag_of(m, true), what);
  return out;
}

void PointToPoint::wait(Transfer& transfer) {
  if (!transfer.state_) return;
  comm_->wait(transfer.state_->header);
  comm_->wait(transfer.state_->data);
  transfer.state_.reset();
}

at::Tensor PointToPoint::recv(int64_t peer, const Message& m, const at::Device& device) {
  check_message(m, peer, size(), rank(), "recv");
  const std::string what = "recv of " + m.text();
  at::Tensor header = at::zeros({kHeader}, at::kLong);
  detail::Pending ph =
      comm_->recv_async(header, static_cast<int>(peer), tag_of(m, false), what + " (its header)", /*header=*/true);
  comm_->wait(ph);
  const auto* h = header.data_ptr<int64_t>();
  const Message got{h[2] == 1 ? Payload::kGradient : Payload::kActivation, h[3], h[4], h[5]};
  FSDP_CHECK_IN(comm_->error_context(what), h[0] == kMagic && h[6] >= 0 && h[6] <= kMaxDims, "fsdp: ", what, " on ",
                where(), ": pipeline rank ", peer,
                " sent something that is not a transfer's header (another program on this job's ports?)");
  FSDP_CHECK_IN(comm_->error_context(what),
                got.payload == m.payload && got.from == m.from && got.to == m.to && got.microbatch == m.microbatch,
                "fsdp: ", what, " on ", where(), ": pipeline rank ", peer, " sent ", got.text(),
                " under its tag: the two ranks run different schedules");
  std::vector<int64_t> shape(h + kFixed, h + kFixed + h[6]);
  const auto dtype = static_cast<at::ScalarType>(h[1]);
  // Received on the host (see send), then copied to the device.
  const bool via_host = device.is_cuda();
  at::Tensor out = at::empty(shape, at::TensorOptions(dtype).device(via_host ? at::Device(at::kCPU) : device));
  detail::Pending pd = comm_->recv_async(out, static_cast<int>(peer), tag_of(m, true), what);
  comm_->wait(pd);
  return via_host ? out.to(device) : out;
}

const CommStats& PointToPoint::comm_stats() const {
  return comm_->stats();
}

void PointToPoint::reset_comm_stats() {
  comm_->stats() = CommStats{};
  comm_->log().reset();
}

}  // namespace pp
}  // namespace fsdp
