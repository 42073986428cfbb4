// Pipeline schedules as action lists (pp/schedule.h) and their validator (pp/simulate.h): every
// schedule validates, its simulated bubble and microbatches in flight are its formula's, and the
// validator refuses hand-made lists (a missing receive, a deadlock, an action before what it
// needs, too few microbatches, a count the interleaved schedule cannot divide), naming the action.
#include "fsdp/fsdp.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <string>

namespace fsdp::pp {
namespace {

std::string refusal(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(PipelineSchedules, ActionsReadAsTheyAreWritten) {
  for (const auto kind :
       {ActionKind::kForward, ActionKind::kBackward, ActionKind::kBackwardInput, ActionKind::kBackwardWeight,
        ActionKind::kSendForward, ActionKind::kRecvForward, ActionKind::kSendBackward, ActionKind::kRecvBackward}) {
    const Action a{kind, 12, 345};
    EXPECT_EQ(Action::parse(a.text()), a) << a.text();
  }
  EXPECT_EQ(Action{ActionKind::kSendForward}.text(), "0SEND_F0");
  EXPECT_EQ((Action{ActionKind::kRecvBackward, 1, 2}.text()), "1RECV_B2");
  const auto lists = make_schedule(ScheduleKind::kInterleaved1F1B, StageLayout(2, 2), 4);
  EXPECT_EQ(parse_lists(format_lists(lists)), lists);
  EXPECT_NE(refusal([] { parse_lists("0F0, 0X3\n"); }).find("line 1 (rank 0): fsdp::pp: '0X3' is not an action"),
            std::string::npos);
  EXPECT_NE(refusal([] { parse_schedule("pipedream"); }).find("the schedules are gpipe, 1f1b"), std::string::npos);
}

// Uniform times (a forward 1, a backward 2 as input 1 + weight 1): GPipe and 1F1B idle every rank
// (p-1)/(m+p-1) of the step; interleaved adds (p-1)/(v m) of the ideal step (m v (f + b)); zero
// bubble idles less than 1F1B. Activations held at the peak: GPipe m, 1F1B p - r on rank r.
TEST(PipelineSchedules, EveryScheduleValidatesWithItsBubbleAndMemory) {
  const ActionCosts costs{1.0, 1.0, 1.0, 0.0};
  for (const int64_t p : {1, 2, 3, 4, 8}) {
    for (const int64_t m : {p, p + 1, 2 * p, 4 * p + 3}) {
      const std::string label = "p " + std::to_string(p) + ", m " + std::to_string(m);
      const double formula = static_cast<double>(p - 1) / static_cast<double>(m + p - 1);
      const StageLayout one(p);
      for (const auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
        const auto t = simulate(make_schedule(kind, one, m), one, m, costs);
        for (int64_t r = 0; r < p; ++r) {
          EXPECT_NEAR(t.rank_bubble[r], formula, 1e-12) << to_string(kind) << ", " << label << ", rank " << r;
          EXPECT_EQ(t.peak_in_flight[r], kind == ScheduleKind::kGPipe ? m : std::min(m, p - r))
              << to_string(kind) << ", " << label << ", rank " << r;
        }
        EXPECT_DOUBLE_EQ(t.step, 3.0 * static_cast<double>(m + p - 1)) << to_string(kind) << ", " << label;
      }
      // Zero bubble: ZB-H1's step, 3m + (p-1) (the bubble (p-1)(F + I - W)), at most 2p-1-r in
      // flight on rank r (each until its weight gradient).
      const auto zb = simulate(make_schedule(ScheduleKind::kZeroBubble, one, m), one, m, costs);
      EXPECT_DOUBLE_EQ(zb.step, static_cast<double>(3 * m + p - 1)) << "zero bubble, " << label;
      for (int64_t r = 0; r < p; ++r) EXPECT_LE(zb.peak_in_flight[r], 2 * p - 1 - r) << "zero bubble, " << label;
      if (m % p == 0) {
        for (const int64_t v : {1, 2, 3}) {
          const StageLayout looped(p, v);
          const auto t = simulate(make_schedule(ScheduleKind::kInterleaved1F1B, looped, m), looped, m, costs);
          const double ideal = 3.0 * static_cast<double>(m * v);
          EXPECT_NEAR((t.step - ideal) / ideal, static_cast<double>(p - 1) / static_cast<double>(v * m), 1e-12)
              << "interleaved, v " << v << ", " << label;
        }
      }
    }
  }
}

// Hand-made lists: each refused before anything runs, naming the first offending action.
TEST(PipelineSchedules, TheValidatorRefusesWhatCannotRun) {
  const StageLayout two(2);
  const auto gpipe = make_schedule(ScheduleKind::kGPipe, two, 2);
  // rank 0: 0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1
  // rank 1: 1RECV_F0,1F0,1RECV_F1,1F1,1B0,1SEND_B0,1B1,1SEND_B1
  ASSERT_EQ(format_lists(gpipe),
            "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
            "1RECV_F0,1F0,1RECV_F1,1F1,1B0,1SEND_B0,1B1,1SEND_B1\n");
  EXPECT_NO_THROW(validate(gpipe, two, 2));

  auto no_recv = gpipe;
  no_recv[1].erase(no_recv[1].begin() + 2);  // 1RECV_F1
  EXPECT_NE(refusal([&] {
              validate(no_recv, two, 2);
            }).find("rank 0's action 3, 0SEND_F1, has no receive: rank 1's list holds no 1RECV_F1"),
            std::string::npos)
      << refusal([&] { validate(no_recv, two, 2); });

  auto deadlock = gpipe;  // rank 0 waits for a gradient before it sends the activations
  std::rotate(deadlock[0].begin() + 1, deadlock[0].begin() + 4, deadlock[0].begin() + 5);
  const std::string d = refusal([&] { validate(deadlock, two, 2); });
  EXPECT_NE(d.find("the order deadlocks: rank 0 waits at its action 1, 0RECV_B0, for rank 1's 1SEND_B0 (its action 5), "
                   "while rank 1 is at its action 0, 1RECV_F0; rank 1 waits at its action 0, 1RECV_F0, for rank 0's "
                   "0SEND_F0"),
            std::string::npos)
      << d;

  auto early = gpipe;  // a send before the forward that makes what it sends
  std::swap(early[0][0], early[0][1]);
  EXPECT_NE(
      refusal([&] { validate(early, two, 2); }).find("rank 0's action 0, 0SEND_F0, comes before 0F0, which it needs"),
      std::string::npos);

  auto half = gpipe;  // stage 1 forgets microbatch 1's backward: its input gradient is never sent
  half[1].erase(half[1].begin() + 6, half[1].end());
  half[0].erase(half[0].begin() + 6, half[0].end());
  EXPECT_NE(refusal([&] { validate(half, two, 2); }).find("stage 0 (rank 0) never completes microbatch 1's backward"),
            std::string::npos)
      << refusal([&] { validate(half, two, 2); });

  EXPECT_NE(refusal([&] { validate(gpipe, StageLayout(3), 2); }).find("2 lists for 3 pipeline ranks"),
            std::string::npos);
  auto foreign = gpipe;
  foreign[0][0].stage = 1;
  EXPECT_NE(
      refusal([&] { validate(foreign, two, 2); }).find("rank 0's action 0, 1F0, is of stage 1, which rank 1 holds"),
      std::string::npos);

  // Too few microbatches for 1F1B (PyTorch's Schedule1F1B refuses it too), a count interleaving
  // cannot divide into rounds of p, a one-stage schedule on several stages per rank.
  EXPECT_NE(refusal([] {
              make_schedule(ScheduleKind::k1F1B, StageLayout(2), 1);
            }).find("needs at least as many microbatches as pipeline ranks: 1 microbatches for 2 ranks"),
            std::string::npos);
  EXPECT_NE(refusal([] {
              make_schedule(ScheduleKind::kInterleaved1F1B, StageLayout(2, 2), 3);
            }).find("3 is not a multiple of 2; use 4 or 2 microbatches"),
            std::string::npos);
  EXPECT_NE(
      refusal([] { make_schedule(ScheduleKind::kGPipe, StageLayout(2, 2), 4); }).find("runs one stage per rank, not 2"),
      std::string::npos);
}

}  // namespace
}  // namespace fsdp::pp
