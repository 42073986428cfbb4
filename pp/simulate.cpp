#include "pp/simulate.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace fsdp::pp {
namespace {

// An action's key: (kind, stage, microbatch) as one number.
int64_t key(ActionKind kind, int64_t stage, int64_t mb, int64_t S, int64_t M) {
  return (static_cast<int64_t>(kind) * S + stage) * M + mb;
}

struct Where {
  int64_t rank = -1, index = -1;
};

std::string at(int64_t rank, int64_t index, const Action& a) {
  return "rank " + std::to_string(rank) + "'s action " + std::to_string(index) + ", " + a.text() + ",";
}

[[noreturn]] void refuse(const std::string& why) {
  throw std::invalid_argument("fsdp::pp: invalid schedule: " + why);
}

// The send a receive pairs with, and the reverse.
Action partner(const Action& a) {
  switch (a.kind) {
    case ActionKind::kSendForward:
      return {ActionKind::kRecvForward, a.stage + 1, a.microbatch};
    case ActionKind::kRecvForward:
      return {ActionKind::kSendForward, a.stage - 1, a.microbatch};
    case ActionKind::kSendBackward:
      return {ActionKind::kRecvBackward, a.stage - 1, a.microbatch};
    default:  // kRecvBackward
      return {ActionKind::kSendBackward, a.stage + 1, a.microbatch};
  }
}

}  // namespace

Timeline simulate(const ActionLists& lists, const StageLayout& layout, int64_t microbatches, const ActionCosts& costs) {
  const int64_t P = layout.ranks(), S = layout.stages(), M = microbatches;
  if (static_cast<int64_t>(lists.size()) != P) {
    refuse(std::to_string(lists.size()) + " lists for " + std::to_string(P) + " pipeline ranks: one per rank");
  }
  if (M < 1) refuse(std::to_string(M) + " microbatches: at least one");
  // Every action once, on the rank of its stage, of a microbatch in range.
  std::unordered_map<int64_t, Where> where;
  for (int64_t r = 0; r < P; ++r) {
    const auto& list = lists[static_cast<size_t>(r)];
    for (int64_t i = 0; i < static_cast<int64_t>(list.size()); ++i) {
      const Action& a = list[static_cast<size_t>(i)];
      if (a.stage < 0 || a.stage >= S) {
        refuse(at(r, i, a) + " is of stage " + std::to_string(a.stage) + "; the pipeline has stages 0-" +
               std::to_string(S - 1));
      }
      if (layout.rank_of(a.stage) != r) {
        refuse(at(r, i, a) + " is of stage " + std::to_string(a.stage) + ", which rank " +
               std::to_string(layout.rank_of(a.stage)) + " holds");
      }
      if (a.microbatch < 0 || a.microbatch >= M) {
        refuse(at(r, i, a) + " is of microbatch " + std::to_string(a.microbatch) + "; there are " + std::to_string(M));
      }
      const auto k = key(a.kind, a.stage, a.microbatch, S, M);
      const auto it = where.find(k);
      if (it != where.end())
        refuse(at(r, i, a) + " repeats rank " + std::to_string(it->second.rank) + "'s action " +
               std::to_string(it->second.index));
      where[k] = {r, i};
    }
  }
  // Transfers pair up across ranks, and only across ranks.
  for (int64_t r = 0; r < P; ++r) {
    const auto& list = lists[static_cast<size_t>(r)];
    for (int64_t i = 0; i < static_cast<int64_t>(list.size()); ++i) {
      const Action& a = list[static_cast<size_t>(i)];
      if (!a.is_send() && !a.is_recv()) continue;
      const int64_t peer = a.peer_stage();
      if (peer < 0 || peer >= S)
        refuse(at(r, i, a) + " has no stage " + std::to_string(peer) + " to " +
               (a.is_send() ? "send to" : "receive from"));
      const int64_t peer_rank = layout.rank_of(peer);
      if (peer_rank == r) {
        refuse(at(r, i, a) + " is a transfer between stages " + std::to_string(a.stage) + " and " +
               std::to_string(peer) + ", which rank " + std::to_string(r) + " both holds: they hand over in memory");
      }
      const Action p = partner(a);
      if (where.count(key(p.kind, p.stage, p.microbatch, S, M)) == 0) {
        refuse(at(r, i, a) + (a.is_send() ? " has no receive" : " has no send") + ": rank " +
               std::to_string(peer_rank) + "'s list holds no " + p.text());
      }
    }
  }
  // What each computation needs and what marks it done, per rank.
  std::unordered_map<int64_t, double> done;  // key -> the time it completed (sends: posted)
  auto is_done = [&](ActionKind kind, int64_t s, int64_t m) { return done.count(key(kind, s, m, S, M)) != 0; };
  auto local = [&](int64_t s, int64_t r) { return s >= 0 && s < S && layout.rank_of(s) == r; };
  // What `a` (on rank r) needs that this rank has not done: the alternatives (B or I), empty if
  // it can run.
  auto missing = [&](const Action& a, int64_t r) -> std::vector<Action> {
    const int64_t s = a.stage, m = a.microbatch;
    auto need = [&](ActionKind kind, int64_t stage) -> std::vector<Action> {
      if (is_done(kind, stage, m)) return {};
      return {Action{kind, stage, m}};
    };
    auto backward_of = [&](int64_t stage) -> std::vector<Action> {
      if (is_done(ActionKind::kBackward, stage, m) || is_done(ActionKind::kBackwardInput, stage, m)) return {};
      return {Action{ActionKind::kBackward, stage, m}, Action{ActionKind::kBackwardInput, stage, m}};
    };
    switch (a.kind) {
      case ActionKind::kForward:
        if (s == 0) return {};
        return local(s - 1, r) ? need(ActionKind::kForward, s - 1) : need(ActionKind::kRecvForward, s);
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput: {
        auto f = need(ActionKind::kForward, s);
        if (!f.empty() || s == S - 1) return f;
        return local(s + 1, r) ? backward_of(s + 1) : need(ActionKind::kRecvBackward, s);
      }
      case ActionKind::kBackwardWeight:
        return need(ActionKind::kBackwardInput, s);
      case ActionKind::kSendForward:
        return need(ActionKind::kForward, s);
      case ActionKind::kSendBackward:
        return backward_of(s);
      default:
        return {};  // receives wait on their peer, below
    }
  };
  // "comes before 0F1, which it needs" (later in the list), or "needs 1RECV_F0, which its list does not hold".
  auto explain = [&](const std::vector<Action>& need, int64_t r) {
    std::string names;
    bool later = false;
    for (const Action& n : need) {
      names += (names.empty() ? "" : " or ") + n.text();
      const auto it = where.find(key(n.kind, n.stage, n.microbatch, S, M));
      later = later || (it != where.end() && it->second.rank == r);
    }
    return later ? " comes before " + names + ", which it needs"
                 : " needs " + names + ", which rank " + std::to_string(r) + "'s list does not hold";
  };
  Timeline t;
  t.busy.assign(static_cast<size_t>(P), 0.0);
  t.peak_in_flight.assign(static_cast<size_t>(P), 0);
  std::vector<double> clock(static_cast<size_t>(P), 0.0);
  std::vector<int64_t> next(static_cast<size_t>(P), 0), in_flight(static_cast<size_t>(P), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t r = 0; r < P; ++r) {
      const auto& list = lists[static_cast<size_t>(r)];
      auto& i = next[static_cast<size_t>(r)];
      auto& now = clock[static_cast<size_t>(r)];
      while (i < static_cast<int64_t>(list.size())) {
        const Action& a = list[static_cast<size_t>(i)];
        if (a.is_recv()) {
          const Action p = partner(a);
          const auto sent = done.find(key(p.kind, p.stage, p.microbatch, S, M));
          if (sent == done.end()) break;  // blocked: its send is not posted yet
          now = std::max(now, sent->second + costs.transfer);
        } else {
          const std::vector<Action> need = missing(a, r);
          if (!need.empty()) refuse(at(r, i, a) + explain(need, r));
          double cost = 0;
          if (a.kind == ActionKind::kForward) cost = costs.forward;
          if (a.kind == ActionKind::kBackward) cost = costs.backward_input + costs.backward_weight;
          if (a.kind == ActionKind::kBackwardInput) cost = costs.backward_input;
          if (a.kind == ActionKind::kBackwardWeight) cost = costs.backward_weight;
          now += cost;
          t.busy[static_cast<size_t>(r)] += cost;
          auto& held = in_flight[static_cast<size_t>(r)];
          if (a.kind == ActionKind::kForward) held += 1;
          if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) held -= 1;
          t.peak_in_flight[static_cast<size_t>(r)] = std::max(t.peak_in_flight[static_cast<size_t>(r)], held);
        }
        done[key(a.kind, a.stage, a.microbatch, S, M)] = now;
        ++i;
        progress = true;
      }
    }
  }
  // Stuck: every unfinished rank waits on a receive whose send its peer has not reached.
  std::string waits;
  for (int64_t r = 0; r < P; ++r) {
    const auto& list = lists[static_cast<size_t>(r)];
    const int64_t i = next[static_cast<size_t>(r)];
    if (i >= static_cast<int64_t>(list.size())) continue;
    const Action& a = list[static_cast<size_t>(i)];
    const Action p = partner(a);
    const Where w = where.at(key(p.kind, p.stage, p.microbatch, S, M));
    const int64_t at_peer = next[static_cast<size_t>(w.rank)];
    waits += (waits.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " waits at its action " +
             std::to_string(i) + ", " + a.text() + ", for rank " + std::to_string(w.rank) + "'s " + p.text() +
             " (its action " + std::to_string(w.index) + "), while rank " + std::to_string(w.rank) + " is at " +
             (at_peer < static_cast<int64_t>(lists[static_cast<size_t>(w.rank)].size())
                  ? "its action " + std::to_string(at_peer) + ", " +
                        lists[static_cast<size_t>(w.rank)][static_cast<size_t>(at_peer)].text()
                  : std::string("its end"));
  }
  if (!waits.empty()) refuse("the order deadlocks: " + waits);
  // Complete: every stage runs every microbatch forward and backward.
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t m = 0; m < M; ++m) {
      const std::string which = "stage " + std::to_string(s) + " (rank " + std::to_string(layout.rank_of(s)) + ")";
      if (!is_done(ActionKind::kForward, s, m))
        refuse(which + " never runs microbatch " + std::to_string(m) + " forward");
      const bool whole = is_done(ActionKind::kBackward, s, m);
      const bool split = is_done(ActionKind::kBackwardInput, s, m) && is_done(ActionKind::kBackwardWeight, s, m);
      if (whole == split) {
        refuse(which + (whole ? " runs microbatch " + std::to_string(m) + "'s backward twice (B, and I with W)"
                              : " never completes microbatch " + std::to_string(m) + "'s backward (B, or I and W)"));
      }
    }
  }
  t.step = *std::max_element(clock.begin(), clock.end());
  t.rank_bubble.resize(static_cast<size_t>(P));
  for (int64_t r = 0; r < P; ++r) {
    t.rank_bubble[static_cast<size_t>(r)] = t.step > 0 ? 1.0 - t.busy[static_cast<size_t>(r)] / t.step : 0.0;
    t.bubble = std::max(t.bubble, t.rank_bubble[static_cast<size_t>(r)]);
  }
  return t;
}

void validate(const ActionLists& lists, const StageLayout& layout, int64_t microbatches) {
  simulate(lists, layout, microbatches);
}

}  // namespace fsdp::pp
