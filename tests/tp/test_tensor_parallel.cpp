// The device mesh and the tensor-parallel layers (fsdp::tp): a small model of every layer (a
// vocabulary-parallel embedding, a column- then row-parallel MLP, a column-parallel head and the
// vocabulary-parallel loss) against the same model of plain LibTorch layers in one process, at
// tensor-parallel sizes 1, 2 and 4, with and without sequence parallelism: loss, every gradient
// (this rank's part of the plain model's), and the collectives counted, from shapes. All cases
// run in one 4-rank launch.
#include "fsdp/fsdp.h"
#include "tests/harness.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <filesystem>
#include <fstream>
#include <thread>

namespace fsdp::testing {
namespace {

constexpr int64_t kB = 2, kS = 8, kC = 16, kH = 32, kV = 24;

// The plain model, built in the order the parallel one builds its layers.
struct Plain {
  torch::nn::Embedding emb{kV, kC};
  torch::nn::Linear up{torch::nn::LinearOptions(kC, kH)};
  torch::nn::Linear down{torch::nn::LinearOptions(kH, kC)};
  torch::nn::Linear head{torch::nn::LinearOptions(kC, kV).bias(false)};
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& targets) {
    auto h = emb(ids);
    auto y = h + down(torch::gelu(up(h)));
    return torch::nn::functional::cross_entropy(head(y).view({-1, kV}), targets.view({-1}));
  }
};

struct Parallel {
  Parallel(const tp::Group& blocks, const tp::Group& vocab, bool sp)
      : emb(vocab, tp::VocabParallelEmbeddingOptions(kV, kC).sequence_parallel(sp)),
        up(blocks, tp::ColumnParallelLinearOptions(kC, kH).sequence_parallel(sp)),
        down(blocks, tp::RowParallelLinearOptions(kH, kC).sequence_parallel(sp)),
        head(vocab, tp::ColumnParallelLinearOptions(kC, kV).bias(false).sequence_parallel(sp)),
        vocab(vocab) {}
  tp::VocabParallelEmbedding emb;
  tp::ColumnParallelLinear up;
  tp::RowParallelLinear down;
  tp::ColumnParallelLinear head;
  tp::Group vocab;
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& targets) {
    auto h = emb(ids);  // [B, S, C], or [B, S / T, C] under sequence parallelism
    auto y = h + down(torch::gelu(up(h)));
    return tp::vocab_parallel_cross_entropy(head(y), targets, vocab);
  }
};

// `part` of `full` along `dim` for rank `r` of `T`.
torch::Tensor part(const torch::Tensor& full, int64_t dim, int r, int T) {
  const int64_t n = full.size(dim) / T;
  return full.narrow(dim, r * n, n);
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got - want).abs().max().item<double>();
  const double scale = want.abs().max().item<double>();
  EXPECT_LE(err, 1e-5 * std::max(1.0, scale)) << what << ": max difference " << err;
}

// One model at tensor-parallel size T (the blocks' group and the vocabulary's: same ranks,
// counted apart), against the plain model.
void check_layers(const tp::Group& blocks, const tp::Group& vocab, bool sp) {
  const int T = blocks.size(), r = blocks.rank();
  const std::string label = "T " + std::to_string(T) + (sp ? ", sequence parallel" : "");
  torch::manual_seed(11);
  Plain plain;
  torch::manual_seed(11);
  Parallel par(blocks, vocab, sp);
  torch::manual_seed(12);
  auto ids = torch::randint(kV, {kB, kS});
  auto targets = torch::randint(kV, {kB, kS});
  targets[0][3] = -100;  // ignored: neither counted nor differentiated

  auto want = plain.loss(ids, targets);
  want.backward();
  auto got = par.loss(ids, targets);
  got.backward();
  EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-6 * std::abs(want.item<double>())) << label;
  expect_close(par.emb->weight.grad(), part(plain.emb->weight.grad(), 0, r, T), label + ": embedding");
  expect_close(par.up->weight.grad(), part(plain.up->weight.grad(), 0, r, T), label + ": up weight");
  expect_close(par.up->bias.grad(), part(plain.up->bias.grad(), 0, r, T), label + ": up bias");
  expect_close(par.down->weight.grad(), part(plain.down->weight.grad(), 1, r, T), label + ": down weight");
  expect_close(par.down->bias.grad(), plain.down->bias.grad(), label + ": down bias");
  expect_close(par.head->weight.grad(), part(plain.head->weight.grad(), 0, r, T), label + ": head");
  // And the weights themselves: the plain model's parts, whatever T is.
  EXPECT_TRUE(torch::equal(par.down->weight, part(plain.down->weight, 1, r, T))) << label;
  EXPECT_TRUE(torch::equal(par.emb->weight, part(plain.emb->weight, 0, r, T))) << label;

  // The collectives, from shapes: BSC = the activations' elements, BS = the tokens.
  const int64_t BSC = kB * kS * kC, BS = kB * kS;
  const CommStats& b = blocks.comm_stats();
  const CommStats& v = vocab.comm_stats();
  if (!sp) {
    // The MLP: the row layer's all-reduce forward, the column layer's input gradient backward.
    EXPECT_EQ(b.all_reduces, 2) << label;
    EXPECT_EQ(b.all_gathers + b.reduce_scatters, 0) << label;
    EXPECT_EQ(b.elements, 2 * 2 * BSC) << label;
    // The embedding's all-reduce forward, the head's input gradient, the loss's three of BS.
    EXPECT_EQ(v.all_reduces, 1 + 1 + 3) << label;
    EXPECT_EQ(v.elements, 2 * (2 * BSC + 3 * BS)) << label;
  } else {
    // All-gather (up, forward), reduce-scatter (down, forward) and their transposes backward, of
    // BSC elements each; the down bias's gradient all-reduced (C elements).
    EXPECT_EQ(b.all_gathers, 2) << label;
    EXPECT_EQ(b.reduce_scatters, 2) << label;
    EXPECT_EQ(b.all_reduces, 1) << label;
    EXPECT_EQ(b.elements, 4 * BSC + 2 * kC) << label;
    // The embedding's reduce-scatter (its gradient all-gathered back), the head's all-gather and
    // reduce-scatter, the loss's three all-reduces.
    EXPECT_EQ(v.reduce_scatters, 2) << label;
    EXPECT_EQ(v.all_gathers, 2) << label;
    EXPECT_EQ(v.all_reduces, 3) << label;
    EXPECT_EQ(v.elements, 4 * BSC + 2 * 3 * BS) << label;
  }
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(TensorParallel, LayersMatchOneProcessAtEveryTensorParallelSize) {
  run_ranks(4, [](Rank& r) {
    // The mesh: coordinates row-major, tp fastest; the groups along each dimension.
    DeviceMesh mesh(r.pg, {{kShardDim, 2}, {kTensorDim, 2}});
    EXPECT_EQ(mesh.coordinate(kTensorDim), r.rank % 2);
    EXPECT_EQ(mesh.coordinate(kShardDim), r.rank / 2);
    EXPECT_EQ(mesh.group_ranks(kTensorDim), (std::vector<int>{r.rank / 2 * 2, r.rank / 2 * 2 + 1}));
    EXPECT_EQ(mesh.group_ranks(kShardDim), (std::vector<int>{r.rank % 2, r.rank % 2 + 2}));
    EXPECT_EQ(mesh.group_ranks(kDataDim), mesh.group_ranks(kShardDim));
    EXPECT_EQ(mesh.size(kReplicateDim), 1);
    EXPECT_EQ(mesh.group(kReplicateDim)->getSize(), 1);
    EXPECT_EQ(mesh.group(kTensorDim)->getSize(), 2);
    DeviceMesh hybrid(r.pg, {{kReplicateDim, 2}, {kShardDim, 2}});
    EXPECT_EQ(hybrid.group_ranks(kDataDim), (std::vector<int>{0, 1, 2, 3}));
    EXPECT_EQ(hybrid.coordinate(kDataDim), r.rank);
    EXPECT_EQ(hybrid.group_ranks(kReplicateDim), (std::vector<int>{r.rank % 2, r.rank % 2 + 2}));
    EXPECT_EQ(hybrid.size(kTensorDim), 1);
    DeviceMesh tp4(r.pg, {{kTensorDim, 4}});
    DeviceMesh dp4(r.pg, {{kShardDim, 4}});

    for (bool sp : {false, true}) {
      for (const DeviceMesh* m : {&dp4, &mesh, &tp4}) {
        tp::Group blocks(*m), vocab(*m);
        check_layers(blocks, vocab, sp);
      }
    }

    // Gathered output and a full input: the plain layers' results on every rank.
    {
      tp::Group g(tp4);
      torch::manual_seed(21);
      torch::nn::Linear a(kC, kH), b(kH, kC);
      torch::manual_seed(21);
      tp::ColumnParallelLinear pa(g, tp::ColumnParallelLinearOptions(kC, kH).gather_output(true));
      tp::RowParallelLinear pb(g, tp::RowParallelLinearOptions(kH, kC).input_is_parallel(false));
      auto x = torch::randn({3, kC});
      expect_close(pa(x), a(x), "gathered output");
      expect_close(pb(a(x)), b(a(x)), "full input");
      EXPECT_EQ(g.comm_stats().all_gathers, 1);
      EXPECT_EQ(g.comm_stats().all_reduces, 1);
    }

    // Bad input, each with what, where (rank and mesh coordinates) and what to do.
    tp::Group g(tp4);
    auto e = error_of([&] { tp::ColumnParallelLinear(g, tp::ColumnParallelLinearOptions(kC, 6)); });
    EXPECT_NE(e.find("(6) is not divisible by the 4 tensor-parallel ranks"), std::string::npos) << e;
    EXPECT_NE(
        e.find("global rank " + std::to_string(r.rank) + " of 4 at (tp " + std::to_string(r.rank) + ") of mesh (tp 4)"),
        std::string::npos)
        << e;
    e = error_of([&] { tp::VocabParallelEmbedding(g, tp::VocabParallelEmbeddingOptions(10, 4)); });
    EXPECT_NE(e.find("Pad the vocabulary to a multiple of 4"), std::string::npos) << e;
    tp::VocabParallelEmbedding emb(g, tp::VocabParallelEmbeddingOptions(kV, 4));
    e = error_of([&] { emb(torch::tensor({int64_t{3}, kV})); });
    EXPECT_NE(e.find("token id 24 is outside the vocabulary [0, 24)"), std::string::npos) << e;
    e = error_of([&] { tp::vocab_parallel_cross_entropy(torch::zeros({5, 6}), torch::tensor({1, 2, 99, 0, 0}), g); });
    EXPECT_NE(e.find("target 99 is outside the vocabulary [0, 24)"), std::string::npos) << e;
    e = error_of([&] { tp::vocab_parallel_cross_entropy(torch::zeros({5, 6}), torch::zeros({4}, torch::kLong), g); });
    EXPECT_NE(e.find("must have the targets' shape"), std::string::npos) << e;
    tp::RowParallelLinear row(g, tp::RowParallelLinearOptions(kH, kC));
    e = error_of([&] { row(torch::zeros({2, kH})); });
    EXPECT_NE(e.find("input's last dimension must be 8 (this rank's columns"), std::string::npos) << e;
    e = error_of([&] { tp::reduce_scatter_to_sequence_region(torch::zeros({2, 6, 3}), g); });
    EXPECT_NE(e.find("6 elements, which the 4 tensor-parallel ranks cannot split evenly"), std::string::npos) << e;
    // Sequence parallelism needs a sequence dimension; a layer's input must have its dtype.
    tp::VocabParallelEmbedding emb_sp(g, tp::VocabParallelEmbeddingOptions(kV, 4).sequence_parallel(true));
    e = error_of([&] { emb_sp(torch::zeros({8}, torch::kLong)); });
    EXPECT_NE(e.find("sequence_parallel reduce-scatters its output along the sequence, dimension 1 of [batch, "
                     "sequence] ids"),
              std::string::npos)
        << e;
    tp::RowParallelLinear row_sp(g, tp::RowParallelLinearOptions(kH, kC).sequence_parallel(true));
    e = error_of([&] { row_sp(torch::zeros({8, kH / 4})); });
    EXPECT_NE(e.find("the input has shape [8, 8]"), std::string::npos) << e;
    e = error_of([&] { row(torch::zeros({2, kH / 4}, torch::kDouble)); });
    EXPECT_NE(e.find("the input is Double but the weight is Float"), std::string::npos) << e;
    e = error_of([&] { DeviceMesh(r.pg, {{kShardDim, 3}, {kTensorDim, 2}}); });
    EXPECT_NE(e.find("mesh (dp_shard 3, tp 2) spans 6 rank(s), but the world has 4"), std::string::npos) << e;
    e = error_of([&] { DeviceMesh(r.pg, {{"cp", 2}, {kTensorDim, 2}}); });
    EXPECT_NE(e.find("unknown dimension 'cp'"), std::string::npos) << e;
    e = error_of([&] { (void)mesh.group("cp"); });
    EXPECT_NE(e.find("no dimension 'cp'"), std::string::npos) << e;
    // Ranks that build different meshes fail at once, each rank's dimensions named (not a
    // subgroup's connection timeout).
    const auto t0 = std::chrono::steady_clock::now();
    e = error_of([&] {
      if (r.rank == 0) {
        DeviceMesh(r.pg, {{kTensorDim, 4}});
      } else {
        DeviceMesh(r.pg, {{kShardDim, 2}, {kTensorDim, 2}});
      }
    });
    EXPECT_NE(e.find("fsdp::DeviceMesh (tp 4)"), std::string::npos) << e;
    EXPECT_NE(e.find("fsdp::DeviceMesh (dp_shard 2, tp 2)"), std::string::npos) << e;
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  });
}

// A collective that a peer never joins fails within the timeout, naming the mesh coordinates and
// the global ranks: two meshes over subgroups of a 4-rank job (ranks 2 and 3 are global ranks 2
// and 3 of 4, not ranks 0 and 1 of their group).
TEST(TensorParallel, FailedCollectiveNamesTheMeshCoordinates) {
  RunOptions o;
  o.collective_timeout = std::chrono::seconds(3);
  run_ranks(
      4,
      [](Rank& r) {
        const int half = r.rank / 2;
        DeviceMesh mesh(new_subgroup(r.pg, {2 * half, 2 * half + 1}, "half" + std::to_string(half)), {{kTensorDim, 2}});
        tp::Group g(mesh);
        const std::string done = shared_dir() + "/done" + std::to_string(half);
        if (r.rank % 2 == 1) {  // never joins, but stays until its peer has seen its collective fail
          for (int i = 0; i < 300 && !std::filesystem::exists(done); ++i) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
          }
          return;
        }
        auto e = error_of([&] { tp::reduce_from_region(torch::ones({4}), g); });
        std::ofstream(done) << "1";
        EXPECT_NE(e.find("global rank " + std::to_string(r.rank) + " of 4 at (tp 0) of mesh (tp 2)"), std::string::npos)
            << e;
        EXPECT_NE(e.find("tensor parallel g forward: all-reduce of a [4] Float activation"), std::string::npos) << e;
      },
      o);
}

}  // namespace
}  // namespace fsdp::testing
