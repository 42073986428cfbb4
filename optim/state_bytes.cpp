#include "optim/state_bytes.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <unordered_set>

namespace fsdp::optim {
namespace {

class StorageCounter {
 public:
  int64_t add(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return 0;
    const void* key = t.storage().unsafeGetStorageImpl();
    if (!seen_.insert(key).second) return 0;
    return static_cast<int64_t>(t.storage().nbytes());
  }

 private:
  std::unordered_set<const void*> seen_;
};

std::vector<at::Tensor> state_tensors(const torch::optim::OptimizerParamState& s) {
  using namespace torch::optim;
  if (auto* a = dynamic_cast<const AdamWParamState*>(&s)) return {a->exp_avg(), a->exp_avg_sq(), a->max_exp_avg_sq()};
  if (auto* a = dynamic_cast<const AdamParamState*>(&s)) return {a->exp_avg(), a->exp_avg_sq(), a->max_exp_avg_sq()};
  if (auto* g = dynamic_cast<const SGDParamState*>(&s)) return {g->momentum_buffer()};
  if (auto* g = dynamic_cast<const AdagradParamState*>(&s)) return {g->sum()};
  if (auto* r = dynamic_cast<const RMSpropParamState*>(&s))
    return {r->square_avg(), r->momentum_buffer(), r->grad_avg()};
  return {};
}

}  // namespace

StateBytes state_bytes(const std::vector<at::Tensor>& params, const torch::optim::Optimizer* optimizer) {
  StorageCounter counter;
  StateBytes out;
  for (const auto& p : params) out.params += counter.add(p);
  for (const auto& p : params) out.grads += counter.add(p.grad());
  // fsdp::optim::FusedAdamW is an AdamW: its per-parameter state views its flat moments, each
  // storage counted once below.
  if (optimizer != nullptr) {
    for (const auto& p : params) {
      auto it = optimizer->state().find(p.unsafeGetTensorImpl());
      if (it == optimizer->state().end()) continue;
      for (const auto& t : state_tensors(*it->second)) out.optimizer += counter.add(t);
    }
  }
  return out;
}

}  // namespace fsdp::optim
