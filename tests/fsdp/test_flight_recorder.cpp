// The flight recorder (fsdp/internal/flight_recorder.h) and fsdp-trace's reading of its files
// (tools/trace_report.h): a stopped peer named behind at its last collective, a dump on a signal
// that lists the collectives issued, the ring's wrap-around and size 0, and the environment's
// malformed values refused.
#include "fsdp/internal/env.h"
#include "fsdp/internal/flight_recorder.h"
#include "fsdp/internal/heartbeat_record.h"
#include "fsdp/internal/monitor.h"
#include "fsdp/process_group.h"
#include "tests/models.h"
#include "tools/trace_report.h"

#include <nlohmann/json.hpp>

#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <thread>

namespace fsdp::testing {
namespace {

using Clock = std::chrono::steady_clock;
using Model = fsdp::FullyShardedModule<gpt::GPTImpl<true>>;

const gpt::Config kCfg{23, 6, 2, 2, 12, true};

void train_step(Model& model, torch::optim::SGD& opt, const Rank& r, int seed) {
  torch::manual_seed(seed);
  auto tok = torch::randint(kCfg.vocab_size, {kGlobalBatch, kCfg.block_size + 1}, torch::kLong);
  auto x = local_rows(tok.narrow(1, 0, kCfg.block_size), r.rank, r.world_size);
  auto y = local_rows(tok.narrow(1, 1, kCfg.block_size), r.rank, r.world_size);
  opt.zero_grad();
  torch::nn::functional::cross_entropy(model(x).flatten(0, 1), y.flatten()).backward();
  opt.step();
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// Waits (at most `limit`) for `path` to exist.
bool wait_for_file(const std::string& path, std::chrono::milliseconds limit) {
  const auto until = Clock::now() + limit;
  while (!exists(path)) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

std::string unit_label(const std::string& name) {
  return "unit '" + (name.empty() ? std::string("<root>") : name) + "'";
}

// Rank 1 stops itself (SIGSTOP) after step 2's optimizer step; rank 0 times out in step 3's first
// collective. Rank 0's error names its dump; fsdp-trace's reading of the directory names rank 1
// behind, at the collective rank 1 really completed last (rank 1 wrote it down before stopping;
// the dump knows it from rank 1's last heartbeat), and rank 0 waiting in the next one. The
// harness SIGKILLs the stopped rank once rank 0 is done (RunOptions::may_die), and whatever
// happens (a failed expectation too).
TEST(FlightRecorder, StoppedPeerIsNamedBehindAtItsLastCollective) {
  RunOptions opts;
  opts.timeout = std::chrono::seconds(60);
  opts.may_die = {1};
  run_ranks(
      2,
      [](Rank& r) {
        auto model =
            fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, FullyShardOptions().timeout(std::chrono::seconds(3)));
        torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
        train_step(model, opt, r, 1);
        train_step(model, opt, r, 2);
        const std::string expected = shared_dir() + "/rank1-last";
        if (r.rank == 1) {
          const auto last = detail::trace_entries().back();
          std::ofstream(expected + ".tmp") << last.group_seq << "\n" << last.what << "\n";
          ::rename((expected + ".tmp").c_str(), expected.c_str());
          // The heartbeat publishes the last collective once a second: let one go out, then stop.
          std::this_thread::sleep_for(std::chrono::milliseconds(1600));  // a 0.6 s margin under load
          std::raise(SIGSTOP);
          return;  // not reached: the harness kills this rank while it is stopped
        }
        const auto start = Clock::now();
        const std::string msg = error_of([&] { train_step(model, opt, r, 3); });
        std::cout << "error after " << std::chrono::duration<double>(Clock::now() - start).count() << " s: " << msg
                  << std::endl;
        ASSERT_FALSE(msg.empty()) << "step 3 did not fail";
        const std::string dir = shared_dir() + "/flight-recorder";
        const std::string file = dir + "/fsdp-trace-rank-0.json";
        EXPECT_NE(
            msg.find("Flight recorder: this rank's last collectives are in " + file + "; `fsdp-trace " + dir + "`"),
            std::string::npos)
            << msg;
        EXPECT_NE(msg.find("failed on global rank 0 of 2"), std::string::npos) << msg;  // the message as before
        EXPECT_NE(msg.find("Peer rank 1 ("), std::string::npos) << msg;
        ASSERT_TRUE(wait_for_file(expected, std::chrono::seconds(5)));
        int64_t expected_seq = -1;
        std::string expected_what;
        {
          std::ifstream in(expected);
          in >> expected_seq;
          in.ignore();
          std::getline(in, expected_what);
        }
        // Rank 1's last collective is step 2's (its backward's last check, as the library works now).
        EXPECT_NE(expected_what.find("backward #2"), std::string::npos) << expected_what;
        EXPECT_NE(msg.find("Its last collective: "), std::string::npos) << "the diagnosis names it too\n" << msg;

        const auto mine = detail::trace_entries().back();  // the collective this rank timed out in
        EXPECT_EQ(mine.state, detail::TraceState::kTimedOut);
        EXPECT_EQ(mine.group_seq, expected_seq + 1) << "rank 0 waits in the collective after rank 1's last";

        ASSERT_TRUE(exists(file)) << file;
        EXPECT_FALSE(exists(dir + "/fsdp-trace-rank-1.json")) << "a stopped rank writes nothing";
        const auto dumps = fsdp::trace::read_dumps({dir});
        ASSERT_EQ(dumps.size(), 1u);
        EXPECT_EQ(dumps[0].reason, "timeout in " + mine.what);
        EXPECT_EQ(dumps[0].entries.size(), detail::trace_entries().size());
        const auto report = fsdp::trace::analyze(dumps);
        std::cout << fsdp::trace::format_text(dumps, report);
        EXPECT_EQ(report.behind, std::vector<int>{1});
        ASSERT_EQ(report.groups.size(), 1u);
        const auto& g = report.groups[0];
        EXPECT_EQ(g.name, "world");
        ASSERT_EQ(g.members.size(), 2u);
        const auto& one = g.members[1];
        EXPECT_EQ(one.source, "heartbeat");
        ASSERT_TRUE(one.last.has_value());
        EXPECT_EQ(one.last->group_seq, expected_seq);
        EXPECT_EQ(one.last->what, expected_what);
        EXPECT_EQ(one.last->state, "completed");
        ASSERT_TRUE(g.waiting_in.has_value());
        EXPECT_EQ(g.waiting, std::vector<int>{0});
        EXPECT_EQ(g.waiting_in->what, mine.what);
        EXPECT_EQ(g.waiting_in->state, "timed out");
        EXPECT_NE(g.verdict.find("rank 1 is behind; rank 1: its last collective is #" + std::to_string(expected_seq) +
                                 " " + expected_what),
                  std::string::npos)
            << g.verdict;
        EXPECT_NE(fsdp::trace::format_json(report).find("\"behind\": [\n    1\n  ]"), std::string::npos);

        // Files of another run beside this one (the default directory is shared) are refused, as
        // are two files of one rank: each would give a confident, wrong verdict.
        auto error_of_read = [](const std::vector<std::string>& paths) {
          try {
            fsdp::trace::read_dumps(paths);
          } catch (const std::exception& e) {
            return std::string(e.what());
          }
          return std::string();
        };
        nlohmann::json mine_json;
        std::ifstream(file) >> mine_json;
        ASSERT_FALSE(mine_json.value("job", "").empty());
        auto write_as_rank1 = [&](const std::string& path, const std::function<void(nlohmann::json&)>& edit) {
          nlohmann::json j = mine_json;
          j["rank"] = 1;
          j["peers"] = nlohmann::json::array();
          edit(j);
          std::ofstream(path) << j.dump();
        };
        const std::string other_run = dir + "/other-run.json", other_pid = dir + "/other-pid.json";
        write_as_rank1(other_run, [](nlohmann::json& j) { j["job"] = "run x, store 127.0.0.1:1, restart 0"; });
        EXPECT_NE(error_of_read({file, other_run}).find("were written by different runs"), std::string::npos);
        // Rank 0's heartbeats named rank 1's process: a rank-1 file of another pid is another run's.
        write_as_rank1(other_pid, [](nlohmann::json& j) { j["pid"] = 1; });
        EXPECT_NE(error_of_read({file, other_pid}).find("names rank 1 as process"), std::string::npos)
            << error_of_read({file, other_pid});
        EXPECT_NE(error_of_read({file, file}).find("two files for rank 0"), std::string::npos);
      },
      opts);
}

// FSDP_DUMP_ON_SIGNAL=USR1: the signal writes this rank's file while training goes on; its entries
// of a step are the step's collectives, as the model's statistics count them, all completed.
TEST(FlightRecorder, DumpOnSignalListsTheCollectivesIssued) {
  RunOptions opts;
  opts.env["FSDP_DUMP_ON_SIGNAL"] = "USR1";
  run_ranks(
      2,
      [](Rank& r) {
        auto model = fsdp::fully_shard(gpt::make_gpt<true>(kCfg), r.pg, test_options());
        torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
        train_step(model, opt, r, 1);
        const int64_t first = detail::trace_recorded();
        const CommStats before = model.comm_stats();
        train_step(model, opt, r, 2);
        const CommStats after = model.comm_stats();
        const std::string file = detail::trace_file(r.rank);
        ASSERT_FALSE(exists(file));
        std::raise(SIGUSR1);
        ASSERT_TRUE(wait_for_file(file, std::chrono::seconds(10))) << file;
        const auto dump = fsdp::trace::read_dump(file);
        EXPECT_EQ(dump.reason, "signal SIGUSR1");
        EXPECT_EQ(dump.rank, r.rank);
        EXPECT_EQ(dump.world_size, 2);
        std::map<std::string, int64_t> ops;
        for (const auto& e : dump.entries) {
          if (e.seq < first) continue;
          ++ops[e.op];
          EXPECT_EQ(e.state, "completed") << e.what;
          EXPECT_EQ(e.group, "world");
          EXPECT_EQ(e.group_ranks, (std::vector<int>{0, 1}));
          EXPECT_GT(e.bytes, 0) << e.what;
          if (e.op == "all-gather" || e.op == "reduce-scatter") {
            bool of_a_unit = false;
            for (const auto& u : model.units())
              of_a_unit = of_a_unit || e.what.find(unit_label(u.name)) != std::string::npos;
            EXPECT_TRUE(of_a_unit) << e.what;
          }
        }
        EXPECT_EQ(ops["all-gather"], after.all_gathers - before.all_gathers);
        EXPECT_EQ(ops["reduce-scatter"], after.reduce_scatters - before.reduce_scatters);
        EXPECT_EQ(ops["all-reduce"], after.all_reduces - before.all_reduces);
        EXPECT_EQ(ops["agreement"], after.checks - before.checks);
        EXPECT_GT(ops["all-gather"], 0);
        int64_t total = 0;
        for (const auto& [op, n] : ops) total += n;
        EXPECT_EQ(total, detail::trace_recorded() - first) << "nothing else was issued in the step";
        ASSERT_EQ(dump.peers.size(), 1u);
        EXPECT_EQ(dump.peers[0].rank, 1 - r.rank);
        EXPECT_FALSE(dump.peers[0].stale);
        // The process goes on: another step, both ranks.
        train_step(model, opt, r, 3);
      },
      opts);
}

// The ring keeps the last N entries, numbered on; an entry overwritten is not updated; size 0
// records nothing and writes no file; an unwritable directory is reported, not thrown.
TEST(FlightRecorder, RingWrapsAroundAndSizeZeroRecordsNothing) {
  auto group = detail::trace_group("test group", {0, 1});
  detail::reset_flight_recorder_for_testing(4);
  for (int i = 0; i < 10; ++i) {
    const int64_t seq = detail::trace_issue(group, "all-gather", "all-gather #" + std::to_string(i), 8, 32,
                                            c10::ScalarType::Float, c10::Device(c10::DeviceType::CPU));
    EXPECT_EQ(seq, i);
    if (i % 2 == 0) detail::trace_end(seq, detail::TraceState::kCompleted);
  }
  detail::trace_end(2, detail::TraceState::kFailed);  // gone from the ring: ignored
  const auto entries = detail::trace_entries();
  ASSERT_EQ(entries.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(entries[i].seq, static_cast<int64_t>(6 + i));
    EXPECT_EQ(entries[i].group_seq, static_cast<int64_t>(6 + i));
    EXPECT_EQ(entries[i].what, "all-gather #" + std::to_string(6 + i));
    EXPECT_EQ(entries[i].state, i % 2 == 0 ? detail::TraceState::kCompleted : detail::TraceState::kIssued);
  }
  EXPECT_EQ(detail::trace_recorded(), 10);
  const auto last = detail::last_collective();
  EXPECT_EQ(last.seq, 9);
  EXPECT_EQ(last.state, "issued");
  EXPECT_EQ(last.text(), "#9 all-gather #9 (group test group #9), issued");
  // A background group's collectives (an AsyncSaver's) are in the ring, not the heartbeat's.
  auto saver = detail::trace_group("saver group", {0, 1}, /*background=*/true);
  detail::trace_issue(saver, "all-gather", "the saver's agreement", 4, 32, c10::ScalarType::Long,
                      c10::Device(c10::DeviceType::CPU));
  EXPECT_EQ(detail::trace_entries().back().what, "the saver's agreement");
  EXPECT_EQ(detail::last_collective().seq, 9);

  // An unwritable directory: the dump says why, and throws nothing.
  ::setenv("FSDP_FLIGHT_RECORDER_DIR", "/dev/null/trace", 1);
  const auto failed = detail::dump_flight_record("testing", detail::PeerDiagnosis{});
  ::unsetenv("FSDP_FLIGHT_RECORDER_DIR");
  EXPECT_TRUE(failed.path.empty());
  EXPECT_NE(failed.error.find("cannot create directory '/dev/null/trace'"), std::string::npos) << failed.error;

  detail::reset_flight_recorder_for_testing(0);
  EXPECT_EQ(
      detail::trace_issue(group, "all-reduce", "off", 1, 4, c10::ScalarType::Float, c10::Device(c10::DeviceType::CPU)),
      -1);
  EXPECT_TRUE(detail::trace_entries().empty());
  EXPECT_FALSE(detail::last_collective().known());
  const auto none = detail::dump_flight_record("testing", detail::PeerDiagnosis{});
  EXPECT_TRUE(none.path.empty() && none.error.empty()) << "size 0: no file, no error";
  EXPECT_EQ(group->issued, 11) << "the group's count goes on, so that ranks stay comparable";
  detail::reset_flight_recorder_for_testing(detail::flight_recorder_size_from_env());
}

// The heartbeat carries the last collective; a record without that field still reads.
TEST(FlightRecorder, HeartbeatCarriesTheLastCollective) {
  detail::LastCollective last{41, "world", 12, "all-gather", "all-gather of unit 'h.1' (a|b, c)", "completed"};
  const std::string rec = detail::encode_heartbeat(7, 1000, "host:12", "pid:[1]", 900, "x|y", false, last, "f|g");
  detail::Heartbeat b;
  ASSERT_TRUE(detail::decode_heartbeat(std::vector<uint8_t>(rec.begin(), rec.end()), b)) << rec;
  EXPECT_EQ(b.seq, 7);
  EXPECT_EQ(b.activity, "x/y");
  EXPECT_EQ(b.failure, "f|g");
  EXPECT_EQ(b.last.seq, 41);
  EXPECT_EQ(b.last.group_seq, 12);
  EXPECT_EQ(b.last.what, "all-gather of unit 'h.1' (a/b, c)");
  const std::string old = "3|1000|host:12|pid:[1]|0||0|";
  ASSERT_TRUE(detail::decode_heartbeat(std::vector<uint8_t>(old.begin(), old.end()), b));
  EXPECT_FALSE(b.last.known());
  EXPECT_EQ(b.failure, "");
}

// Malformed values are refused with the variable, the value and what to give; good ones parse.
TEST(FlightRecorder, MalformedEnvironmentIsRefused) {
  for (const char* bad : {"-1", "abc", "1e3", "2000000", " 5", "0x10", "12345678"}) {
    const std::string msg = error_of([&] { detail::parse_flight_recorder_size(bad, "FSDP_FLIGHT_RECORDER_SIZE"); });
    EXPECT_NE(msg.find(std::string("FSDP_FLIGHT_RECORDER_SIZE='") + bad +
                       "' is not a flight recorder size: give the number of collectives to keep"),
              std::string::npos)
        << bad << ": " << msg;
  }
  EXPECT_EQ(detail::parse_flight_recorder_size("0", "X"), 0u);
  EXPECT_EQ(detail::parse_flight_recorder_size("1000", "X"), 1000u);
  for (const char* bad : {"TERM", "SIGINT", "9", "19", "15", "usr1", "USR3", "-10", ""}) {
    const std::string msg = error_of([&] { detail::parse_dump_signal(bad, "FSDP_DUMP_ON_SIGNAL"); });
    EXPECT_NE(msg.find(std::string("FSDP_DUMP_ON_SIGNAL='") + bad +
                       "' is not a signal for the flight recorder's dump: give USR1 or USR2"),
              std::string::npos)
        << bad << ": " << msg;
  }
  EXPECT_EQ(detail::parse_dump_signal("USR1", "X"), SIGUSR1);
  EXPECT_EQ(detail::parse_dump_signal("SIGUSR2", "X"), SIGUSR2);
  EXPECT_EQ(detail::parse_dump_signal(std::to_string(SIGRTMIN), "X"), SIGRTMIN);
  EXPECT_EQ(detail::parse_dump_signal("0", "X"), 0);
}

// ... and through the library's entry: init_process_group refuses them before any rendezvous,
// every time it is called, and starts once they are fixed.
TEST(FlightRecorder, InitProcessGroupRefusesMalformedVariables) {
  RunOptions opts;
  opts.init_process_group = false;
  opts.env["FSDP_FLIGHT_RECORDER_SIZE"] = "lots";
  run_ranks(
      1,
      [](Rank&) {
        auto init = [] {
          return fsdp::init_process_group(
              InitOptions().rank(0).world_size(1).init_method(std::string("file://") + std::getenv("FSDP_TEST_STORE")));
        };
        std::string msg = error_of(init);
        EXPECT_NE(msg.find("FSDP_FLIGHT_RECORDER_SIZE='lots' is not a flight recorder size"), std::string::npos) << msg;
        ::setenv("FSDP_FLIGHT_RECORDER_SIZE", "16", 1);
        ::setenv("FSDP_DUMP_ON_SIGNAL", "TERM", 1);
        msg = error_of(init);
        EXPECT_NE(msg.find("FSDP_DUMP_ON_SIGNAL='TERM' is not a signal for the flight recorder's dump"),
                  std::string::npos)
            << msg;
        ::unsetenv("FSDP_DUMP_ON_SIGNAL");
        auto pg = init();
        EXPECT_EQ(detail::trace_capacity(), 16u);
      },
      opts);
}

}  // namespace
}  // namespace fsdp::testing
