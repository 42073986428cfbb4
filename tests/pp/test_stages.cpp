// Pipeline stages (pp/stage_split.h, pp/stage_layout.h, pp/init.h) and the Llama built as stages:
// the split of layers checked against every contiguous split (brute force), the placement against
// its definition, and each stage's weights and outputs against the whole model's, bit for bit.
#include "examples/llama/llama.h"
#include "fsdp/fsdp.h"
#include "tests/harness.h"
#include "tests/models.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <set>
#include <stdexcept>

namespace fsdp::testing {
namespace {

using pp::LayerRange;
using pp::StageLayout;
using pp::StageOrder;
using pp::StageSplit;

std::vector<int64_t> counts(const std::vector<LayerRange>& ranges) {
  std::vector<int64_t> c;
  for (const auto& r : ranges) c.push_back(r.size());
  return c;
}

// Every split of `cost.size()` layers into `stages` non-empty contiguous runs: the least heaviest
// stage (embedding on the first, head on the last), and among those the one whose counts are
// lexicographically smallest (the earlier stages lighter).
std::vector<int64_t> brute_force(const std::vector<double>& cost, double first, double last, int64_t stages) {
  const auto L = static_cast<int64_t>(cost.size());
  double best = std::numeric_limits<double>::infinity();
  std::vector<int64_t> best_counts, c;
  std::function<void(int64_t, int64_t, double)> walk = [&](int64_t s, int64_t b, double heaviest) {
    if (s == stages) {
      if (b != L) return;
      if (heaviest < best - 1e-9 || (heaviest <= best + 1e-9 && c < best_counts)) {
        best = std::min(best, heaviest);
        best_counts = c;
      }
      return;
    }
    for (int64_t e = b + 1; e <= L - (stages - s - 1); ++e) {
      double w = (s == 0 ? first : 0) + (s == stages - 1 ? last : 0);
      for (int64_t i = b; i < e; ++i) w += cost[i];
      c.push_back(e - b);
      walk(s + 1, e, std::max(heaviest, w));
      c.pop_back();
    }
  };
  walk(0, 0, 0);
  return best_counts;
}

TEST(PipelineSplit, MatchesTheBestContiguousSplit) {
  // The 5 layers on 2 stages: embedding + 2 layers, then 3 layers + head.
  const auto five = StageSplit::uniform(5).split(2);
  EXPECT_EQ(counts(five), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(five[1].begin, 2);
  EXPECT_EQ(five[1].end, 5);
  EXPECT_TRUE(five[0].first() && !five[0].last() && five[1].last());
  EXPECT_EQ(five[1].text(), "stage 1 of 2 (layers 2-4)");
  for (int64_t L = 1; L <= 9; ++L) {
    for (int64_t S = 1; S <= std::min<int64_t>(L, 5); ++S) {
      for (const double w : {0.0, 1.0, 2.5}) {
        EXPECT_EQ(counts(StageSplit::uniform(L, w, w).split(S)),
                  brute_force(std::vector<double>(static_cast<size_t>(L), 1.0), w, w, S))
            << L << " layers, " << S << " stages, end weights " << w;
      }
    }
  }
  // By parameters: layers of unequal size, a large embedding and head (a Llama's vocabulary).
  const std::vector<int64_t> params{100, 100, 300, 100, 100, 50, 100};
  std::vector<double> as_double(params.begin(), params.end());
  for (int64_t S = 1; S <= 5; ++S) {
    const auto ranges = StageSplit::by_parameters(params, 250, 260).split(S);
    EXPECT_EQ(counts(ranges), brute_force(as_double, 250, 260, S)) << S << " stages by parameters";
    int64_t next = 0;
    for (const auto& r : ranges) {  // contiguous, in order, covering every layer once
      EXPECT_EQ(r.begin, next);
      next = r.end;
    }
    EXPECT_EQ(next, 7);
  }
  EXPECT_EQ(counts(StageSplit::given({3, 1, 2}).split(3)), (std::vector<int64_t>{3, 1, 2}));
}

TEST(PipelineSplit, RefusesWhatCannotBeSplit) {
  auto message = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message([] { StageSplit::uniform(3).split(4); }).find("3 layers cannot fill 4 stages"), std::string::npos);
  EXPECT_NE(message([] {
              StageSplit::given({3, 2}).split(3);
            }).find("the given split has 2 stages, the pipeline 3"),
            std::string::npos);
  EXPECT_NE(message([] {
              StageSplit::given({3, 0});
            }).find("stage 1 of the given split holds 0 layers"),
            std::string::npos);
  EXPECT_NE(message([] { StageLayout(2, 0); }).find("both must be at least 1"), std::string::npos);
  EXPECT_NE(message([] { StageLayout(2, 2).rank_of(4); }).find("stage 4 is outside [0, 4)"), std::string::npos);
}

TEST(PipelineLayout, LoopedAndVShaped) {
  for (const int64_t p : {1, 2, 3, 4}) {
    for (const int64_t v : {1, 2, 3}) {
      for (const auto order : {StageOrder::kLooped, StageOrder::kVShape}) {
        const StageLayout layout(p, v, order);
        std::multiset<int64_t> seen;
        for (int64_t r = 0; r < p; ++r) {
          const auto mine = layout.stages_of(r);
          EXPECT_EQ(static_cast<int64_t>(mine.size()), v);
          for (const int64_t s : mine) {
            seen.insert(s);
            EXPECT_EQ(layout.rank_of(s), r);
            // Round k of the stages runs down the ranks, or (V-shaped, odd k) back up.
            const int64_t k = s / p, i = s % p;
            EXPECT_EQ(r, order == StageOrder::kVShape && k % 2 == 1 ? p - 1 - i : i) << "stage " << s;
          }
        }
        EXPECT_EQ(static_cast<int64_t>(seen.size()), p * v);
        EXPECT_EQ(static_cast<int64_t>(std::set<int64_t>(seen.begin(), seen.end()).size()), p * v);
      }
    }
  }
  EXPECT_EQ(StageLayout(4, 2, StageOrder::kVShape).stages_of(0), (std::vector<int64_t>{0, 7}));
  EXPECT_EQ(StageLayout(4, 2, StageOrder::kLooped).stages_of(1), (std::vector<int64_t>{1, 5}));
}

TEST(PipelineInit, GeneratorBySeedAndName) {
  auto draw = [](uint64_t seed, const std::string& name) {
    return torch::randn({16}, pp::parameter_generator(seed, name));
  };
  torch::manual_seed(1);
  const auto a = draw(7, "model.layers.3.mlp.up_proj.weight");
  torch::randn({1000});  // other draws between do not matter
  EXPECT_TRUE(torch::equal(a, draw(7, "model.layers.3.mlp.up_proj.weight")));
  EXPECT_FALSE(torch::equal(a, draw(8, "model.layers.3.mlp.up_proj.weight")));
  EXPECT_FALSE(torch::equal(a, draw(7, "model.layers.4.mlp.up_proj.weight")));
  torch::manual_seed(1);
  const uint64_t s = pp::draw_seed();
  torch::manual_seed(1);
  EXPECT_EQ(pp::draw_seed(), s);
  EXPECT_NE(pp::draw_seed(), s) << "the next draw differs: two models built in turn differ";
}

llama::Config stage_config(bool tied) {
  llama::Config c;
  c.vocab_size = 64;
  c.block_size = 8;
  c.n_layer = 5;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.n_embd = 32;
  c.intermediate = 48;
  c.tie_word_embeddings = tied;
  return c;
}

// Each stage of the split holds exactly the whole model's parameters of its layers (the
// embedding on the first, norm and head on the last; a tied head's embedding on both), under the
// same names and with the same values; running the stages in turn gives the whole model's logits.
void check_stages(const tp::Group& g, const llama::Config& c, int64_t stages, const std::string& label) {
  torch::manual_seed(3);
  llama::LlamaForCausalLM whole(c, g, g);
  const auto want = whole->named_parameters();
  const auto ids = torch::randint(c.vocab_size, {2, c.block_size});
  const auto logits = whole(ids);
  std::set<std::string> covered;
  torch::Tensor h = ids;
  for (const auto& range : StageSplit::uniform(c.n_layer).split(stages)) {
    torch::manual_seed(3);
    llama::LlamaForCausalLM stage(c, g, g, range);
    for (const auto& p : stage->named_parameters()) {
      ASSERT_TRUE(want.contains(p.key())) << label << ", " << range.text() << ": " << p.key();
      EXPECT_TRUE(torch::equal(p.value(), want[p.key()])) << label << ", " << range.text() << ": " << p.key();
      covered.insert(p.key());
      const bool embedding = p.key() == "model.embed_tokens.weight";
      const bool tail = p.key() == "model.norm.weight" || p.key() == "lm_head.weight";
      if (embedding) {
        EXPECT_TRUE(range.first() || (c.tie_word_embeddings && range.last())) << label << ", " << range.text();
      } else if (tail) {
        EXPECT_TRUE(range.last()) << label << ", " << range.text();
      } else {  // model.layers.N.…: N inside the range, under its global index
        const auto n = std::stoll(p.key().substr(std::string("model.layers.").size()));
        EXPECT_TRUE(range.contains(n)) << label << ", " << range.text() << ": " << p.key();
      }
    }
    h = stage(h);
  }
  EXPECT_EQ(covered.size(), want.size()) << label << ": every parameter on some stage";
  EXPECT_TRUE(torch::equal(h, logits)) << label << ": the stages in turn give the whole model's logits";
}

TEST(PipelineStages, LlamaStagesHoldTheWholeModelsWeights) {
  run_ranks(1, [](Rank& r) {
    const tp::Group g(r.pg);
    for (const bool tied : {false, true}) {
      for (const int64_t stages : {1, 2, 3, 5}) {
        check_stages(g, stage_config(tied), stages, std::to_string(stages) + " stages" + (tied ? ", tied" : ""));
      }
    }
    auto c = stage_config(false);
    try {
      llama::LlamaForCausalLM(c, g, g, LayerRange{1, 2, 3, 7});
      ADD_FAILURE() << "a range past the layers was built";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("stage 1 of 2 (layers 3-6) is not a run of the model's 5 layers"),
                std::string::npos)
          << e.what();
    }
  });
  // Tensor parallel: each rank's part of a stage's weights is its part of the whole model's.
  run_ranks(2, [](Rank& r) {
    const tp::Group g(r.pg);
    check_stages(g, stage_config(true), 2, "tp 2, 2 stages, tied");
  });
}

}  // namespace
}  // namespace fsdp::testing
