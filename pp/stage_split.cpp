#include "pp/stage_split.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <stdexcept>

namespace fsdp::pp {
namespace {

[[noreturn]] void refuse(const std::string& what) {
  throw std::invalid_argument("fsdp::pp::StageSplit: " + what);
}

}  // namespace

std::string LayerRange::text() const {
  std::string s = "stage " + std::to_string(stage) + " of " + std::to_string(stages) + " (layer";
  s += size() == 1 ? " " + std::to_string(begin) : "s " + std::to_string(begin) + "-" + std::to_string(end - 1);
  return s + ")";
}

LayerRange whole_model(int64_t layers) {
  return LayerRange{0, 1, 0, layers};
}

StageSplit StageSplit::uniform(int64_t layers, double first_weight, double last_weight) {
  if (layers < 1) refuse("a model of " + std::to_string(layers) + " layers has none to split");
  if (first_weight < 0 || last_weight < 0) refuse("the first and last stages' weights must not be negative");
  StageSplit s;
  s.costs_.assign(static_cast<size_t>(layers), 1.0);
  s.first_ = first_weight;
  s.last_ = last_weight;
  return s;
}

StageSplit StageSplit::by_parameters(std::vector<int64_t> layer_params, int64_t first_params, int64_t last_params) {
  if (layer_params.empty()) refuse("a model without layers has none to split");
  StageSplit s;
  for (const int64_t p : layer_params) {
    if (p < 0) refuse("a layer's parameter count is negative");
    s.costs_.push_back(static_cast<double>(p));
  }
  s.first_ = static_cast<double>(first_params);
  s.last_ = static_cast<double>(last_params);
  return s;
}

StageSplit StageSplit::given(std::vector<int64_t> layers_per_stage) {
  if (layers_per_stage.empty()) refuse("a given split needs at least one stage");
  StageSplit s;
  int64_t total = 0;
  for (size_t i = 0; i < layers_per_stage.size(); ++i) {
    if (layers_per_stage[i] < 1) {
      refuse("stage " + std::to_string(i) + " of the given split holds " + std::to_string(layers_per_stage[i]) +
             " layers; every stage holds at least one");
    }
    total += layers_per_stage[i];
  }
  s.costs_.assign(static_cast<size_t>(total), 1.0);
  s.given_ = std::move(layers_per_stage);
  return s;
}

std::vector<LayerRange> StageSplit::split(int64_t stages) const {
  const auto L = static_cast<int64_t>(costs_.size());
  if (stages < 1) refuse(std::to_string(stages) + " stages: at least one");
  if (L < stages) {
    refuse(std::to_string(L) + " layers cannot fill " + std::to_string(stages) +
           " stages (each holds at least one layer): use fewer stages or stages per rank");
  }
  std::vector<int64_t> counts;
  if (!given_.empty()) {
    if (static_cast<int64_t>(given_.size()) != stages) {
      refuse("the given split has " + std::to_string(given_.size()) + " stages, the pipeline " +
             std::to_string(stages));
    }
    counts = given_;
  } else {
    // The cost of a stage of layers [b, e): theirs, plus the embedding on the first, the head on the last.
    std::vector<double> prefix(static_cast<size_t>(L) + 1, 0.0);
    for (int64_t i = 0; i < L; ++i) prefix[i + 1] = prefix[i] + costs_[i];
    auto cost = [&](int64_t s, int64_t b, int64_t e) {
      return prefix[e] - prefix[b] + (s == 0 ? first_ : 0.0) + (s == stages - 1 ? last_ : 0.0);
    };
    // best[s][b]: the least possible heaviest stage when stages s.. hold layers b..L-1 (exact: the
    // counts are small, stages x layers^2).
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<std::vector<double>> best(static_cast<size_t>(stages) + 1,
                                          std::vector<double>(static_cast<size_t>(L) + 1, inf));
    best[stages][L] = 0;
    for (int64_t s = stages - 1; s >= 0; --s) {
      for (int64_t b = s; b <= L - (stages - s); ++b) {
        for (int64_t e = b + 1; e <= L - (stages - s - 1); ++e) {
          best[s][b] = std::min(best[s][b], std::max(cost(s, b, e), best[s + 1][e]));
        }
      }
    }
    // Within that maximum, each stage from the first takes as few layers as it may.
    const double max = best[0][0];
    const double slack = 1e-9 * std::max(1.0, max);
    int64_t b = 0;
    for (int64_t s = 0; s < stages; ++s) {
      int64_t e = b + 1;
      while (s == stages - 1 ? e < L : !(cost(s, b, e) <= max + slack && best[s + 1][e] <= max + slack)) ++e;
      counts.push_back(e - b);
      b = e;
    }
  }
  std::vector<LayerRange> ranges;
  int64_t b = 0;
  for (int64_t s = 0; s < stages; ++s) {
    ranges.push_back(LayerRange{s, stages, b, b + counts[s]});
    b += counts[s];
  }
  return ranges;
}

}  // namespace fsdp::pp
