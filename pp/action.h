// fsdp::pp::Action: one step of one rank's pipeline schedule, as torch.distributed.pipelining
// writes them: "0F3" (stage 0's forward of microbatch 3), "1B2" (stage 1's whole backward), "1I2"
// and "1W2" (its backward split into the input-gradient and the weight-gradient part, for zero
// bubble), "0SEND_F3" / "1RECV_F3" (microbatch 3's activations from stage 0 to stage 1),
// "1SEND_B3" / "0RECV_B3" (their gradients back).
//
// Every action names the stage of the rank that performs it: a send the sending stage, a receive
// the receiving one; the peer is the next stage (activations) or the one before (gradients). A
// schedule is one list of actions per pipeline rank (Schedule, pp/schedule.h); as text one line
// per rank, the actions comma-separated (PyTorch's CSV of schedules).
#pragma once

#include "fsdp/export.h"

#include <cstdint>
#include <string>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::pp {

enum class ActionKind {
  kForward,         ///< F
  kBackward,        ///< B: the input and the weight gradients at once
  kBackwardInput,   ///< I: the input gradient only (what the stage before waits for)
  kBackwardWeight,  ///< W: the weight gradient, after its I
  kSendForward,     ///< SEND_F: this stage's output to the next stage
  kRecvForward,     ///< RECV_F: this stage's input from the stage before
  kSendBackward,    ///< SEND_B: this stage's input gradient to the stage before
  kRecvBackward,    ///< RECV_B: this stage's output gradient from the next stage
};

struct Action {
  ActionKind kind = ActionKind::kForward;
  int64_t stage = 0;
  int64_t microbatch = 0;

  bool is_compute() const;
  bool is_send() const { return kind == ActionKind::kSendForward || kind == ActionKind::kSendBackward; }
  bool is_recv() const { return kind == ActionKind::kRecvForward || kind == ActionKind::kRecvBackward; }
  /// The stage at the other end of a send or receive.
  int64_t peer_stage() const;
  /// "0F3", "1SEND_B2".
  std::string text() const;
  /// Parses text(); std::invalid_argument naming `text` otherwise.
  static Action parse(const std::string& text);
  friend bool operator==(const Action& a, const Action& b) {
    return a.kind == b.kind && a.stage == b.stage && a.microbatch == b.microbatch;
  }
  friend bool operator!=(const Action& a, const Action& b) { return !(a == b); }
};

/// One list of actions per pipeline rank, rank-major.
using ActionLists = std::vector<std::vector<Action>>;

/// One line per rank, its actions comma-separated ("0F0,0SEND_F0,0F1,...").
std::string format_lists(const ActionLists& lists);
/// The reverse of format_lists (blank lines and spaces ignored, a line per rank, in order).
/// std::invalid_argument naming the line and the entry otherwise.
ActionLists parse_lists(const std::string& text);

}  // namespace fsdp::pp

FSDP_PUBLIC_END
