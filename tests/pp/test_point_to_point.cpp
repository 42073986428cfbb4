// fsdp::pp::PointToPoint (pp/point_to_point.h) over the "pp" dimension of a DeviceMesh: tensors of
// every microbatch's own shape and dtype arrive exactly, sends posted before their receives
// complete, the counts and bytes are those of the shapes; a receive whose send never comes fails
// within the timeout naming the message, and the flight recorder holds it; bad input is refused.
#include "fsdp/fsdp.h"
#include "tests/harness.h"
#include "tests/models.h"
#include "tools/trace_report.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

namespace fsdp::testing {
namespace {

using pp::Message;
using pp::Payload;

// Microbatch m's tensor from stage s: [2, 3 + m, 4] (sequence lengths differ), values from (s, m).
torch::Tensor payload(int64_t stage, int64_t mb, torch::ScalarType dtype) {
  return (torch::arange(2 * (3 + mb) * 4, torch::kFloat).reshape({2, 3 + mb, 4}) + 100 * stage + 10 * mb).to(dtype);
}

// At 4 ranks as (pp 2, dp_shard 2) the two stages' ranks pair up at the same dp coordinate (global
// ranks 0-2 and 1-3); at 3 ranks as (pp 3) the middle stage receives from the first and sends to
// the last. Each stage sends all its microbatches' activations before it receives any gradient
// (GPipe's order): the sends are in flight together.
TEST(PointToPoint, TransfersOfEveryShapeArriveExactlyAndAreCounted) {
  for (const int world : {4, 3}) {
    run_ranks(world, [world](Rank& r) {
      const std::vector<MeshDim> dims =
          world == 4 ? std::vector<MeshDim>{{kPipeDim, 2}, {kShardDim, 2}} : std::vector<MeshDim>{{kPipeDim, 3}};
      DeviceMesh mesh(r.pg, dims);
      pp::PointToPoint p2p(mesh);
      const int64_t s = p2p.rank(), S = p2p.size();
      EXPECT_EQ(s, mesh.coordinate(kPipeDim));
      EXPECT_EQ(S, world == 4 ? 2 : 3);
      const int64_t M = 3;
      const std::vector<torch::ScalarType> dtypes{torch::kFloat, torch::kBFloat16, torch::kDouble};
      int64_t bytes = 0, sends = 0, recvs = 0;
      // Forward: receive microbatch m from the stage before, send it on (changed) to the next.
      std::vector<pp::Transfer> in_flight;
      std::vector<torch::Tensor> kept;  // what the sends read, alive until their waits
      for (int64_t m = 0; m < M; ++m) {
        torch::Tensor h = payload(0, m, dtypes[m]);
        if (s > 0) {
          h = p2p.recv(s - 1, {Payload::kActivation, s - 1, s, m});
          EXPECT_TRUE(torch::equal(h, payload(s - 1, m, dtypes[m]))) << "stage " << s << " microbatch " << m;
          EXPECT_EQ(h.scalar_type(), dtypes[m]);
          bytes += static_cast<int64_t>(h.nbytes());
          ++recvs;
        }
        if (s < S - 1) {
          // A transposed view: sent in its logical layout.
          auto out = payload(s, m, dtypes[m]).transpose(0, 1).contiguous().transpose(0, 1);
          kept.push_back(out);
          in_flight.push_back(p2p.send(out, s + 1, {Payload::kActivation, s, s + 1, m}));
          EXPECT_TRUE(in_flight.back().pending());
          bytes += static_cast<int64_t>(out.nbytes());
          ++sends;
        }
      }
      // Backward: gradients from the last stage down, in reverse microbatch order.
      for (int64_t m = M - 1; m >= 0; --m) {
        torch::Tensor g = payload(7, m, torch::kFloat);
        if (s < S - 1) {
          g = p2p.recv(s + 1, {Payload::kGradient, s + 1, s, m});
          EXPECT_TRUE(torch::equal(g, payload(7 + s + 1, m, torch::kFloat))) << "gradient, stage " << s;
          bytes += static_cast<int64_t>(g.nbytes());
          ++recvs;
        }
        if (s > 0) {
          auto out = payload(7 + s, m, torch::kFloat);
          kept.push_back(out);
          in_flight.push_back(p2p.send(out, s - 1, {Payload::kGradient, s, s - 1, m}));
          bytes += static_cast<int64_t>(out.nbytes());
          ++sends;
        }
      }
      for (auto& t : in_flight) {
        p2p.wait(t);
        EXPECT_FALSE(t.pending());
      }
      const CommStats& st = p2p.comm_stats();
      // Each transfer is a header and its data: twice the messages, the data's bytes only.
      EXPECT_EQ(st.sends, 2 * sends);
      EXPECT_EQ(st.recvs, 2 * recvs);
      EXPECT_EQ(st.p2p_bytes, bytes);
      EXPECT_EQ(st.all_gathers + st.reduce_scatters + st.all_reduces, 0);
      p2p.reset_comm_stats();
      EXPECT_EQ(p2p.comm_stats().p2p_bytes, 0);
    });
  }
}

// Rank 1 waits for microbatch 5, rank 0 sends microbatch 4: the tags differ, so nothing pairs.
// Both fail within the timeout (3 s), naming the message and the rank; the receiver's flight
// recorder names its wait. Bad input is refused before anything is sent.
TEST(PointToPoint, AnUnmatchedTransferFailsWithinTheTimeoutNamingIt) {
  RunOptions o;
  o.collective_timeout = std::chrono::seconds(3);
  run_ranks(
      2,
      [](Rank& r) {
        DeviceMesh mesh(r.pg, {{kPipeDim, 2}});
        pp::PointToPoint p2p(mesh);
        const auto t0 = std::chrono::steady_clock::now();
        if (r.rank == 0) {
          try {
            p2p.send(torch::ones({2}), 0, {Payload::kActivation, 0, 1, 0});
            ADD_FAILURE() << "a send to itself was accepted";
          } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find("peer 0 is not another rank of the pipeline's 2"), std::string::npos)
                << e.what();
          }
          auto sent = p2p.send(torch::ones({2, 3}), 1, {Payload::kActivation, 0, 1, 4});
          const std::string e = error_of([&] { p2p.wait(sent); });
          EXPECT_NE(e.find("send of microbatch 4's activations from stage 0 to stage 1"), std::string::npos) << e;
          EXPECT_NE(e.find("global rank 0 of 2 at (pp 0) of mesh (pp 2)"), std::string::npos) << e;
          // Alive until rank 1 has seen its own wait fail: its receive then ends by its timeout, not
          // by this process's exit.
          for (int i = 0; i < 300 && !std::filesystem::exists(shared_dir() + "/done"); ++i) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
          }
        } else {
          const std::string e = error_of([&] { p2p.recv(0, {Payload::kActivation, 0, 1, 5}); });
          std::ofstream(shared_dir() + "/done") << "1";
          EXPECT_NE(e.find("recv of microbatch 5's activations from stage 0 to stage 1 (its header) failed on global "
                           "rank 1 of 2 at (pp 1) of mesh (pp 2)"),
                    std::string::npos)
              << e;
          EXPECT_NE(e.find("timeout 3000 ms"), std::string::npos) << e;
          const std::string dir = shared_dir() + "/flight-recorder";
          const auto dumps = fsdp::trace::read_dumps({dir});
          ASSERT_FALSE(dumps.empty());
          bool found = false;
          for (const auto& d : dumps) {
            // "timeout in ...", or "failure in ..." when the peer's own timeout closed the connection first.
            found =
                found || d.reason.find("in recv of microbatch 5's activations from stage 0 to stage 1 (its header)") !=
                             std::string::npos;
          }
          EXPECT_TRUE(found) << "the receiver's dump names its wait";
        }
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
      },
      o);
}

// The mesh's pp dimension: first or refused; fully_shard over a mesh with stages refused, naming
// pp::stage_mesh.
TEST(PointToPoint, MeshWithPipelineStages) {
  run_ranks(2, [](Rank& r) {
    const std::string e = error_of([&] { DeviceMesh(r.pg, {{kShardDim, 1}, {kPipeDim, 2}}); });
    EXPECT_NE(e.find("dimension 'pp' of mesh (dp_shard 1, pp 2) is not the first"), std::string::npos) << e;
    DeviceMesh mesh(r.pg, {{kPipeDim, 2}});
    EXPECT_EQ(mesh.size(kDataDim), 1);
    EXPECT_EQ(mesh.group(kPipeDim)->getSize(), 2);
    torch::nn::Linear lin(4, 4);
    const std::string f = error_of([&] { fully_shard(lin.ptr(), mesh); });
    EXPECT_NE(f.find("has 2 pipeline stages (pp): a model wrapped across stages would block"), std::string::npos) << f;
  });
}

}  // namespace
}  // namespace fsdp::testing
