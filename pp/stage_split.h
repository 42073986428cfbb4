// fsdp::pp::StageSplit: which contiguous run of a model's layers each pipeline stage holds.
//
//   auto split = fsdp::pp::StageSplit::uniform(/*layers=*/5);             // embedding, head: 1 layer each
//   auto ranges = split.split(/*stages=*/2);   // {[0, 2) first, [2, 5) last}: 1 + 2 and 3 + 1
//   fsdp::pp::StageSplit::by_parameters(per_layer, embedding, head).split(4);
//   fsdp::pp::StageSplit::given({3, 2}).split(2);                         // layers 0-2, then 3-4
//
// The first stage also computes the embedding and the last the head (and the final norm), so they
// are weighed as layers (torchtitan's first- and last-stage weights): uniformly as one layer each,
// or by parameter count. The split minimises the heaviest stage; among equal maxima it makes the
// earlier stages the lighter, since under 1F1B the first stage holds the most microbatches'
// activations at its peak. Every stage holds at least one layer; a layer keeps its global index
// (a stage of layers 4-7 names them model.layers.4 to 7, not 0 to 3).
#pragma once

#include "fsdp/export.h"

#include <cstdint>
#include <string>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::pp {

/// The layers [begin, end) of stage `stage` of `stages`.
struct LayerRange {
  int64_t stage = 0, stages = 1;
  int64_t begin = 0, end = 0;
  bool first() const { return stage == 0; }
  bool last() const { return stage == stages - 1; }
  int64_t size() const { return end - begin; }
  bool contains(int64_t layer) const { return layer >= begin && layer < end; }
  /// "stage 1 of 2 (layers 2-4)".
  std::string text() const;
};

/// The whole model as one stage: every layer, the embedding and the head.
LayerRange whole_model(int64_t layers);

class StageSplit {
 public:
  /// Every layer weighs 1, the embedding `first_weight` and the head `last_weight` (added to the
  /// first and last stage).
  static StageSplit uniform(int64_t layers, double first_weight = 1.0, double last_weight = 1.0);
  /// Each layer weighs its parameters (`layer_params[i]` for layer i), the first stage also
  /// `first_params` (the embedding), the last `last_params` (final norm and head).
  static StageSplit by_parameters(std::vector<int64_t> layer_params, int64_t first_params, int64_t last_params);
  /// Stage s holds `layers_per_stage[s]` layers, in order.
  static StageSplit given(std::vector<int64_t> layers_per_stage);

  /// The ranges of `stages` stages, in stage order. Throws std::invalid_argument, naming the
  /// numbers, when there are fewer layers than stages or a given split does not fit (another
  /// count of stages, a stage without layers).
  std::vector<LayerRange> split(int64_t stages) const;
  int64_t layers() const { return static_cast<int64_t>(costs_.size()); }

 private:
  std::vector<double> costs_;
  double first_ = 0, last_ = 0;
  std::vector<int64_t> given_;  // empty unless given()
};

}  // namespace fsdp::pp

FSDP_PUBLIC_END
