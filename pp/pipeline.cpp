#include "pp/pipeline.h"

#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"
#include "fsdp/process_group.h"
#include "pp/simulate.h"
#include "pp/split_backward.h"

#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <stdexcept>
#include <string>

namespace fsdp::pp {

struct Pipeline::Slot {
  at::Tensor input;     // the stage's input: a leaf that requires grad, except on the first stage
  at::Tensor output;    // its output, or on the last stage the microbatch's scaled loss
  at::Tensor grad_out;  // the gradient of `output` (undefined on the last stage: the loss's is 1)
  at::Tensor grad_in;   // the gradient at `input`, for the stage before
  WeightPass weights;   // zero bubble: what its input pass kept for its weight pass
};

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// For one step, the FSDP stages under the pipeline's controls (pipeline.h): gradient sync off,
// resharding as the stage asks; back to the defaults (sync as it was) when the step ends, also
// when it throws.
class DrivenStages {
 public:
  explicit DrivenStages(std::map<int64_t, Stage>& stages) : stages_(stages) {
    for (auto& [index, stage] : stages_) {
      if (!stage.module) continue;
      synced_[index] = stage.module->requires_gradient_sync();
      stage.module->set_requires_gradient_sync(false);
      stage.module->set_reshard_after_forward(stage.reshard_between_microbatches);
      stage.module->set_reshard_after_backward(stage.reshard_between_microbatches);
    }
  }
  ~DrivenStages() {
    for (auto& [index, stage] : stages_) {
      if (!stage.module) continue;
      stage.module->set_requires_gradient_sync(synced_[index]);
      stage.module->set_reshard_after_forward(true);
      stage.module->set_reshard_after_backward(true);
    }
  }
  DrivenStages(const DrivenStages&) = delete;
  DrivenStages& operator=(const DrivenStages&) = delete;

 private:
  std::map<int64_t, Stage>& stages_;
  std::map<int64_t, bool> synced_;  // each FSDP stage's gradient sync before the step
};

}  // namespace

Pipeline::Pipeline(const DeviceMesh& mesh, const StageLayout& layout, ActionLists lists, int64_t microbatches,
                   std::vector<Stage> stages, const at::Device& device)
    : p2p_(mesh), layout_(layout), lists_(std::move(lists)), microbatches_(microbatches), device_(device) {
  if (layout.ranks() != p2p_.size()) {
    throw std::invalid_argument("fsdp::pp::Pipeline: the layout has " + std::to_string(layout.ranks()) +
                                " pipeline ranks, the mesh's pp dimension " + std::to_string(p2p_.size()));
  }
  // The transfers' tags hold stages below 512 and microbatches below 2^20 (pp/point_to_point.h):
  // refused here, on every rank alike, not at a first transfer on some ranks.
  if (layout.stages() >= 512 || microbatches >= (int64_t{1} << 20)) {
    throw std::invalid_argument("fsdp::pp::Pipeline: " + std::to_string(layout.stages()) + " stages and " +
                                std::to_string(microbatches) +
                                " microbatches; the transfers take fewer than 512 stages and 2^20 microbatches");
  }
  for (auto& s : stages) {
    if (layout_.rank_of(s.index) != p2p_.rank()) {
      throw std::invalid_argument("fsdp::pp::Pipeline: stage " + std::to_string(s.index) + " is pipeline rank " +
                                  std::to_string(layout_.rank_of(s.index)) + "'s, not this rank's (" +
                                  std::to_string(p2p_.rank()) + ")");
    }
    if (!s.forward)
      throw std::invalid_argument("fsdp::pp::Pipeline: stage " + std::to_string(s.index) + " has no forward");
    if (s.module && s.parameters.empty()) s.parameters = s.module->parameters();
    const int64_t index = s.index;
    stages_.emplace(index, std::move(s));
  }
  for (const int64_t s : layout_.stages_of(p2p_.rank())) {
    if (stages_.count(s) == 0) {
      throw std::invalid_argument("fsdp::pp::Pipeline: pipeline rank " + std::to_string(p2p_.rank()) + " holds stage " +
                                  std::to_string(s) + " in the layout, but was not given it");
    }
  }
  // Every pipeline rank runs the same lists: a fingerprint of them, its least and largest value
  // over the pipeline's ranks (one bounded all-reduce each).
  const uint64_t mine = detail::Fingerprint().add(format_lists(lists_)).add(microbatches_).value();
  const auto group = mesh.group(kPipeDim);
  at::Tensor lo = at::full({1}, static_cast<int64_t>(mine >> 1), at::kLong), hi = lo.clone();
  fsdp::all_reduce(group, lo, c10d::ReduceOp::MIN);
  fsdp::all_reduce(group, hi, c10d::ReduceOp::MAX);
  FSDP_CHECK(lo.item<int64_t>() == hi.item<int64_t>(), "fsdp::pp::Pipeline on ", p2p_.where(),
             ": the pipeline's ranks were given different schedules (action lists or microbatch counts); build "
             "them from the same schedule, microbatches and layout on every rank");
  // The same lists everywhere: every rank refuses them alike, or none does.
  validate(lists_, layout_, microbatches_);
}

StepReport Pipeline::step(const Input& input, const Loss& loss) {
  StepReport report;
  const auto start = clock_type::now();
  const auto before = p2p_.comm_stats().p2p_bytes;
  const int64_t S = layout_.stages(), me = p2p_.rank();
  std::map<std::pair<int64_t, int64_t>, Slot> slots;  // (stage, microbatch)
  // Sends in flight, each keeping what it reads alive until it completes. An activation's send is
  // complete once its gradient came back (the peer received it before it could send that): waited
  // for and dropped then; the rest at the step's end.
  std::vector<Transfer> sends;
  std::map<std::pair<int64_t, int64_t>, Transfer> activations_sent;  // (stage, microbatch)
  int64_t in_flight = 0;
  std::vector<at::Tensor> losses;  // the last stage's, detached
  auto waited = [&](const std::function<void()>& fn) {
    const auto t = clock_type::now();
    fn();
    report.p2p_wait_seconds += seconds_since(t);
  };
  auto local = [&](int64_t s) { return s >= 0 && s < S && layout_.rank_of(s) == me; };
  // B: autograd from the slot's output into every leaf (the parameters and the input); I: to the
  // input only, keeping what W needs (pp/split_backward.h); W: the weights' part. The microbatch's
  // tensors go after B or W, but the gradient it sends back.
  auto backward = [&](int64_t s, Slot& slot, ActionKind kind) {
    Stage& stage = stages_.at(s);
    const bool input_leaf = slot.input.defined() && slot.input.requires_grad();
    if (kind == ActionKind::kBackwardWeight) {
      // W adds into the full parameters' gradients; with a stage resharded between microbatches,
      // gathered for it and freed after.
      const bool gather = stage.module && !slot.weights.empty();
      if (gather) stage.module->unshard();
      slot.weights.run();
      if (gather && stage.reshard_between_microbatches) stage.module->reshard();
    } else if (kind == ActionKind::kBackwardInput) {
      slot.weights = backward_input(slot.output, slot.grad_out, input_leaf ? slot.input : at::Tensor(),
                                    stage.parameters, slot.grad_in);
    } else {
      std::vector<at::Tensor> grads;
      if (slot.grad_out.defined()) grads.push_back(slot.grad_out);
      torch::autograd::backward({slot.output}, grads);
      if (input_leaf) slot.grad_in = slot.input.grad().defined() ? slot.input.grad() : at::zeros_like(slot.input);
    }
    slot.output = at::Tensor();  // after I, the weight pass holds what it needs of the graph
    slot.input = at::Tensor();
    slot.grad_out = at::Tensor();
  };
  // FSDP stages: gathered once, reduced once (see pipeline.h), after each one's last backward.
  std::map<int64_t, size_t> last_backward;  // stage -> position in this rank's list
  const auto& list = lists_[static_cast<size_t>(me)];
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].kind == ActionKind::kBackward || list[i].kind == ActionKind::kBackwardWeight) {
      last_backward[list[i].stage] = i;
    }
  }
  const DrivenStages driven(stages_);
  for (size_t i = 0; i < list.size(); ++i) {
    const Action& a = list[i];
    const int64_t s = a.stage, m = a.microbatch;
    Slot& slot = slots[{s, m}];
    switch (a.kind) {
      case ActionKind::kRecvForward:
        waited([&] { slot.input = p2p_.recv(layout_.rank_of(s - 1), {Payload::kActivation, s - 1, s, m}, device_); });
        slot.input.requires_grad_(true);
        break;
      case ActionKind::kForward: {
        if (s == 0) {
          slot.input = input(m);
        } else if (local(s - 1)) {  // handed over in memory by this rank's stage before
          auto& prev = slots.at({s - 1, m});
          slot.input = prev.output.detach().requires_grad_(true);
        }
        FSDP_CHECK(slot.input.defined(), "fsdp::pp::Pipeline on ", p2p_.where(), ": ", a.text(), " has no input");
        auto out = stages_.at(s).forward(slot.input);
        slot.output = s == S - 1 ? loss(out, m) : out;
        if (s == S - 1) losses.push_back(slot.output.detach().to(at::kDouble));
        report.peak_in_flight = std::max(report.peak_in_flight, ++in_flight);
        break;
      }
      case ActionKind::kSendForward: {
        activations_sent.emplace(std::make_pair(s, m), p2p_.send(slot.output.detach(), layout_.rank_of(s + 1),
                                                                 {Payload::kActivation, s, s + 1, m}));
        break;
      }
      case ActionKind::kRecvBackward:
        waited([&] {
          slot.grad_out = p2p_.recv(layout_.rank_of(s + 1), {Payload::kGradient, s + 1, s, m}, device_);
          const auto it = activations_sent.find({s, m});
          if (it != activations_sent.end()) {
            p2p_.wait(it->second);
            activations_sent.erase(it);
          }
        });
        break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput: {
        if (s < S - 1 && local(s + 1)) slot.grad_out = slots.at({s + 1, m}).grad_in;
        backward(s, slot, a.kind);
        if (a.kind == ActionKind::kBackward) --in_flight;
        break;
      }
      case ActionKind::kBackwardWeight:
        backward(s, slot, a.kind);
        --in_flight;
        break;
      case ActionKind::kSendBackward: {
        sends.push_back(p2p_.send(slot.grad_in, layout_.rank_of(s - 1), {Payload::kGradient, s, s - 1, m}));
        slot.grad_in = at::Tensor();
        break;
      }
    }
    const auto last = last_backward.find(s);
    if (last != last_backward.end() && last->second == i && stages_.at(s).module) {
      stages_.at(s).module->reduce_gradients();
    }
  }
  waited([&] {
    for (auto& t : sends) p2p_.wait(t);
    for (auto& sent : activations_sent) p2p_.wait(sent.second);
  });
  // One read of the losses at the end (on a GPU, one synchronisation per step, not per microbatch).
  for (const auto& l : losses) report.loss += l.item<double>();
  report.step_seconds = seconds_since(start);
  report.p2p_bytes = p2p_.comm_stats().p2p_bytes - before;
  return report;
}

}  // namespace fsdp::pp
