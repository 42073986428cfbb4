#include "pp/schedule.h"

#include <algorithm>
#include <deque>
#include <stdexcept>

namespace fsdp::pp {
namespace {

[[noreturn]] void refuse(ScheduleKind kind, const std::string& why) {
  throw std::invalid_argument("fsdp::pp: the " + to_string(kind) + " schedule " + why);
}

// Where the neighbouring stage is on another rank: the receive before the computation that needs
// it, the send after the one that produced it (sends complete asynchronously, receives block).
std::vector<Action> with_transfers(const std::vector<Action>& compute, const StageLayout& layout, int64_t rank) {
  const int64_t S = layout.stages();
  auto remote = [&](int64_t stage) { return stage >= 0 && stage < S && layout.rank_of(stage) != rank; };
  std::vector<Action> out;
  for (const Action& a : compute) {
    const int64_t s = a.stage, m = a.microbatch;
    switch (a.kind) {
      case ActionKind::kForward:
        if (remote(s - 1)) out.push_back({ActionKind::kRecvForward, s, m});
        out.push_back(a);
        if (remote(s + 1)) out.push_back({ActionKind::kSendForward, s, m});
        break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
        if (remote(s + 1)) out.push_back({ActionKind::kRecvBackward, s, m});
        out.push_back(a);
        if (remote(s - 1)) out.push_back({ActionKind::kSendBackward, s, m});
        break;
      default:
        out.push_back(a);
    }
  }
  return out;
}

// 1F1B's order on one stage: `warmup` forwards, then a forward and a backward in turn, then the
// remaining backwards.
std::vector<Action> one_f_one_b(int64_t stage, int64_t warmup, int64_t m) {
  std::vector<Action> out;
  for (int64_t i = 0; i < warmup; ++i) out.push_back({ActionKind::kForward, stage, i});
  for (int64_t i = 0; i < m - warmup; ++i) {
    out.push_back({ActionKind::kForward, stage, warmup + i});
    out.push_back({ActionKind::kBackward, stage, i});
  }
  for (int64_t i = m - warmup; i < m; ++i) out.push_back({ActionKind::kBackward, stage, i});
  return out;
}

// Zero bubble (ZB-H1) on one stage per rank, found by list scheduling with unit times: whenever a
// rank is free it takes the first of an input gradient it can compute (the stage before waits for
// it), a forward it can compute while fewer than 2p-1-r microbatches are in flight on it, and a
// deferred weight gradient; among ranks, the earliest start first. With equal times this reaches
// ZB-H1's step, 3m + (p-1) units against 1F1B's 3(m + p - 1).
std::vector<std::vector<Action>> zero_bubble(int64_t p, int64_t m) {
  std::vector<std::vector<Action>> order(static_cast<size_t>(p));
  std::vector<double> clock(static_cast<size_t>(p), 0);
  const double never = -1;
  std::vector<std::vector<double>> f_done(static_cast<size_t>(p), std::vector<double>(static_cast<size_t>(m), never));
  auto i_done = f_done;
  std::vector<int64_t> next_f(static_cast<size_t>(p), 0), next_i(static_cast<size_t>(p), 0),
      held(static_cast<size_t>(p), 0);
  std::vector<std::deque<int64_t>> weights(static_cast<size_t>(p));
  for (int64_t work = 0; work < 3 * p * m; ++work) {
    // (start, priority, rank): the earliest action any rank can take next.
    double best_start = 0;
    int64_t best_prio = 3, best_rank = -1;
    for (int64_t r = 0; r < p; ++r) {
      const auto R = static_cast<size_t>(r);
      auto consider = [&](double ready, int64_t prio) {
        const double start = std::max(clock[R], ready);
        if (best_rank < 0 || start < best_start || (start == best_start && prio < best_prio)) {
          best_start = start;
          best_prio = prio;
          best_rank = r;
        }
      };
      const int64_t i = next_i[R];
      if (i < m && f_done[R][static_cast<size_t>(i)] != never) {
        const double grad = r == p - 1 ? f_done[R][static_cast<size_t>(i)] : i_done[R + 1][static_cast<size_t>(i)];
        if (grad != never) consider(grad, 0);
      }
      const int64_t f = next_f[R];
      if (f < m && held[R] < 2 * p - 1 - r) {
        const double input = r == 0 ? 0.0 : f_done[R - 1][static_cast<size_t>(f)];
        if (input != never) consider(input, 1);
      }
      if (!weights[R].empty()) consider(clock[R], 2);
    }
    const auto R = static_cast<size_t>(best_rank);
    clock[R] = best_start + 1;
    if (best_prio == 0) {
      const int64_t i = next_i[R]++;
      i_done[R][static_cast<size_t>(i)] = clock[R];
      weights[R].push_back(i);
      order[R].push_back({ActionKind::kBackwardInput, best_rank, i});
    } else if (best_prio == 1) {
      const int64_t f = next_f[R]++;
      f_done[R][static_cast<size_t>(f)] = clock[R];
      ++held[R];
      order[R].push_back({ActionKind::kForward, best_rank, f});
    } else {
      --held[R];
      order[R].push_back({ActionKind::kBackwardWeight, best_rank, weights[R].front()});
      weights[R].pop_front();
    }
  }
  return order;
}

}  // namespace

std::string to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe:
      return "gpipe";
    case ScheduleKind::k1F1B:
      return "1f1b";
    case ScheduleKind::kInterleaved1F1B:
      return "interleaved";
    case ScheduleKind::kZeroBubble:
      return "zero-bubble";
  }
  return "?";
}

ScheduleKind parse_schedule(const std::string& name) {
  for (const auto k :
       {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B, ScheduleKind::kZeroBubble}) {
    if (to_string(k) == name) return k;
  }
  throw std::invalid_argument("fsdp::pp: no schedule '" + name + "'; the schedules are gpipe, 1f1b, interleaved and " +
                              "zero-bubble");
}

ActionLists make_schedule(ScheduleKind kind, const StageLayout& layout, int64_t microbatches) {
  const int64_t p = layout.ranks(), v = layout.stages_per_rank(), m = microbatches;
  if (m < 1) refuse(kind, "needs at least one microbatch, not " + std::to_string(m));
  if (kind != ScheduleKind::kInterleaved1F1B && v != 1) {
    refuse(kind, "runs one stage per rank, not " + std::to_string(v) + ": use the interleaved schedule for several");
  }
  if (layout.order() != StageOrder::kLooped) refuse(kind, "runs on a looped layout, not a V-shaped one");
  if (kind != ScheduleKind::kGPipe && m < p) {
    refuse(kind, "needs at least as many microbatches as pipeline ranks: " + std::to_string(m) + " microbatches for " +
                     std::to_string(p) + " ranks never fill the pipe, a bubble of half the step or more (PyTorch's " +
                     "Schedule1F1B refuses it too); use at least " + std::to_string(p) + " microbatches, or gpipe");
  }
  if (kind == ScheduleKind::kInterleaved1F1B && m % p != 0) {
    refuse(kind, "runs the microbatches in rounds of " + std::to_string(p) +
                     " (the pipeline ranks): " + std::to_string(m) + " is not a multiple of " + std::to_string(p) +
                     "; use " + std::to_string((m / p + 1) * p) + " or " + std::to_string(m / p * p) + " microbatches");
  }
  ActionLists lists(static_cast<size_t>(p));
  const auto zb = kind == ScheduleKind::kZeroBubble ? zero_bubble(p, m) : std::vector<std::vector<Action>>{};
  for (int64_t r = 0; r < p; ++r) {
    std::vector<Action> compute;
    switch (kind) {
      case ScheduleKind::kGPipe:
        for (int64_t i = 0; i < m; ++i) compute.push_back({ActionKind::kForward, r, i});
        for (int64_t i = 0; i < m; ++i) compute.push_back({ActionKind::kBackward, r, i});
        break;
      case ScheduleKind::k1F1B:
        compute = one_f_one_b(r, std::min(m, p - 1 - r), m);
        break;
      case ScheduleKind::kZeroBubble:
        compute = zb[static_cast<size_t>(r)];
        break;
      case ScheduleKind::kInterleaved1F1B: {
        // Megatron-LM's order of (chunk, microbatch) over the m v computations of each direction.
        const int64_t total = m * v;
        auto mb = [&](int64_t k) { return (k / (p * v)) * p + k % p; };
        auto forward = [&](int64_t k) { return Action{ActionKind::kForward, ((k / p) % v) * p + r, mb(k)}; };
        auto backward = [&](int64_t k) { return Action{ActionKind::kBackward, (v - 1 - (k / p) % v) * p + r, mb(k)}; };
        const int64_t warmup = std::min(total, (p - r - 1) * 2 + (v - 1) * p);
        for (int64_t k = 0; k < warmup; ++k) compute.push_back(forward(k));
        for (int64_t i = 0; i < total - warmup; ++i) {
          compute.push_back(forward(warmup + i));
          compute.push_back(backward(i));
        }
        for (int64_t i = total - warmup; i < total; ++i) compute.push_back(backward(i));
        break;
      }
    }
    lists[static_cast<size_t>(r)] = with_transfers(compute, layout, r);
  }
  return lists;
}

}  // namespace fsdp::pp
