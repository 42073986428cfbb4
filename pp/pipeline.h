// fsdp::pp::Pipeline: runs a schedule's action list (pp/schedule.h) on this rank's stages, one
// training step at a time: each stage's forward on its microbatches, their backwards (whole, or
// split into the input and the weight gradient for zero bubble), and the transfers between stages
// (pp/point_to_point.h).
//
//   fsdp::pp::StageLayout layout(mesh.size("pp"));
//   auto lists = fsdp::pp::make_schedule(fsdp::pp::ScheduleKind::k1F1B, layout, M);
//   fsdp::pp::Pipeline pipe(mesh, layout, lists, M, {{stage, [&](const at::Tensor& x) { return net(x); },
//                                                     net->parameters()}});
//   auto r = pipe.step([&](int64_t m) { return ids_of(m); },                       // the first stage's inputs
//                      [&](const at::Tensor& out, int64_t m) { return loss_of(out, m); });  // the last stage's
//   opt.step();   // each stage's gradients, summed over the microbatches
//
// The constructor validates the lists (pp/simulate.h: every rank simulates all ranks' lists, so
// no step starts on a schedule that would hang) and checks that every pipeline rank holds the
// same lists, bounded by the mesh's timeout; a refusal is std::invalid_argument naming the action,
// a difference between ranks an fsdp::Error on every rank.
//
// The loss function returns microbatch m's share of the step's loss (for one process's
// equivalent over the global batch: its mean loss times its tokens over the batch's); its
// backward accumulates into the stage's gradients, as gradient accumulation does. Each stage's
// input is a leaf of its own graph (received, or handed over in memory by this rank's previous
// stage), so a stage's backward stops at its input and the gradient there goes back a stage.
//
// Zero bubble's split backward: the input pass (I) runs autograd from the stage's output to its
// input only, keeping the graph; the weight pass (W) runs it again from the output to the stage's
// parameters, so that their gradients accumulate through their AccumulateGrad nodes (hooks fire)
// and the graph is freed. The second pass recomputes the activation gradients along the way
// (PyTorch's stage_backward_weight avoids this by starting from the gradients the first pass
// captured at the weight-consuming nodes); it costs more compute than zero bubble's W, not
// correctness.
#pragma once

#include "fsdp/device_mesh.h"
#include "fsdp/export.h"
#include "pp/action.h"
#include "pp/point_to_point.h"
#include "pp/stage_layout.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::pp {

/// One stage this rank holds: its index, its computation (token ids on the first stage, the
/// previous stage's output elsewhere; returns what the next stage takes, or what the loss takes
/// on the last) and the parameters its weight-gradient pass differentiates.
struct Stage {
  int64_t index = 0;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::vector<at::Tensor> parameters;
};

/// What one step did on this rank.
struct StepReport {
  double loss = 0;              ///< the sum of the last stage's microbatch losses (0 on other ranks)
  double step_seconds = 0;      ///< the step, from its first action to its last send's completion
  double p2p_wait_seconds = 0;  ///< spent waiting on receives and on sends to complete
  int64_t peak_in_flight = 0;   ///< the most microbatch-stages held at once (forward run, backward not)
  int64_t p2p_bytes = 0;        ///< sent plus received (PointToPoint's count)
  double bubble() const { return step_seconds > 0 ? p2p_wait_seconds / step_seconds : 0.0; }
};

class Pipeline {
 public:
  using Input = std::function<at::Tensor(int64_t microbatch)>;
  using Loss = std::function<at::Tensor(const at::Tensor& output, int64_t microbatch)>;

  /// Over `mesh`'s pp group; `stages`: the stages `layout` gives this rank (any order).
  /// Collective over the pipeline's ranks (the lists' check).
  Pipeline(const DeviceMesh& mesh, const StageLayout& layout, ActionLists lists, int64_t microbatches,
           std::vector<Stage> stages, const at::Device& device = at::kCPU);

  /// One step's actions. `input(m)`: microbatch m's input of the first stage (called on its rank
  /// only); `loss(out, m)`: its scaled loss from the last stage's output (its rank only).
  StepReport step(const Input& input, const Loss& loss);

  const StageLayout& layout() const { return layout_; }
  const ActionLists& lists() const { return lists_; }
  int64_t microbatches() const { return microbatches_; }
  PointToPoint& p2p() { return p2p_; }

 private:
  struct Slot;  // one stage and microbatch's tensors while in flight
  PointToPoint p2p_;
  StageLayout layout_;
  ActionLists lists_;
  int64_t microbatches_;
  std::map<int64_t, Stage> stages_;  // by index
  at::Device device_;
};

}  // namespace fsdp::pp

FSDP_PUBLIC_END
