#include "fsdp/fully_shard.h"

#include "fsdp/internal/run_state.h"
#include "fsdp/internal/unit.h"
#include "fsdp/internal/wrap.h"

#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace fsdp {

using detail::RunState;
using detail::shard_model;

FSDPModule::FSDPModule(std::shared_ptr<torch::nn::Module> module, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                       const FullyShardOptions& options)
    : module_(std::move(module)), root_(shard_model(module_, pg, options)) {
  reset_comm_stats();  // what wrapping sent (the model check, rank 0's weights) is not training's
}

FSDPModule::FSDPModule(std::shared_ptr<torch::nn::Module> module, ShardingScope& scope) : module_(std::move(module)) {
  TORCH_CHECK(scope.state() != nullptr, "fsdp::fully_shard: the ShardingScope has no state");
  TORCH_CHECK(scope.state()->groups.empty(), "fsdp::fully_shard (rank ", scope.state()->comm.rank(),
              "): this ShardingScope already wrapped a model; open one scope per model.");
  scope.close();
  root_ = shard_model(module_, scope.process_group(), scope.state()->options, scope.state());
  reset_comm_stats();
}

detail::ForwardCasts FSDPModule::root_pre_forward() {
  root_->state().begin_forward();
  root_->state().in_root_forward = true;
  root_->pre_forward();
  return {root_->input_cast(), root_->output_cast()};
}

void FSDPModule::root_post_forward(const std::vector<at::Tensor>& outputs) {
  root_->post_forward(outputs);
  root_->state().end_forward();
}

void FSDPModule::root_forward_ended() {
  root_->state().in_root_forward = false;
}

void FSDPModule::begin_access() const {
  ++root_->state().direct_access;
}
void FSDPModule::end_access(bool threw) const {
  RunState& state = root_->state();
  --state.direct_access;
  // Between steps the module's parameters are shards: a forward called on the module itself
  // (model->forward(x)) fails in its first operation that needs a full shape, with an error that
  // says nothing of the wrapper. Said here, as the error leaves the call.
  const bool refused = std::exchange(state.access_error_explained, false);
  if (threw && !refused && state.direct_access == 0 && !state.in_root_forward) {
    TORCH_WARN("fsdp (rank ", state.comm.rank(),
               "): an error left a call through the handle's operator->. If that call was the module's own "
               "forward (model->forward(x)), it ran around the wrapper on this rank's shards; call the handle "
               "itself: model(x) or model.forward(x).");
  }
}

torch::OrderedDict<std::string, at::Tensor> FSDPModule::named_parameters(bool recurse) const {
  return module_->named_parameters(recurse);
}

std::vector<at::Tensor> FSDPModule::parameters(bool recurse) const {
  // Once each: a weight tied inside a unit appears under two names but is one tensor, and an
  // optimizer given it twice would step it twice.
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& t : module_->parameters(recurse)) {
    if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  }
  return out;
}

torch::OrderedDict<std::string, at::Tensor> FSDPModule::named_buffers(bool recurse) const {
  return module_->named_buffers(recurse);
}
std::vector<at::Tensor> FSDPModule::buffers(bool recurse) const {
  return module_->buffers(recurse);
}

void FSDPModule::train(bool on) {
  module_->train(on);
}
bool FSDPModule::is_training() const {
  return module_->is_training();
}

namespace {
// The handle's to(): every unit refuses a change (a wrapped model's dtype and device are fixed).
void check_conversion(const RunState& state, const std::optional<at::Device>& device,
                      const std::optional<at::ScalarType>& dtype) {
  for (const auto& w : state.groups) {
    if (auto g = w.lock()) g->check_conversion(device, dtype, /*converting=*/false);
  }
}
}  // namespace

void FSDPModule::to(at::Device device, at::ScalarType dtype) {
  check_conversion(root_->state(), device, dtype);
}
void FSDPModule::to(at::ScalarType dtype) {
  check_conversion(root_->state(), std::nullopt, dtype);
}
void FSDPModule::to(at::Device device) {
  check_conversion(root_->state(), device, std::nullopt);
}

torch::OrderedDict<std::string, at::Tensor> FSDPModule::full_state_dict(bool rank0_only) const {
  RunState& state = root_->state();
  state.check_not_broken();
  TORCH_CHECK(!state.in_backward(), "fsdp::full_state_dict (", state.comm.where(),
              "): called during backward; call it between steps.");
  state.check_boundary(RunState::Boundary::kFullStateDict, rank0_only ? 1 : 0, 0,
                       std::string("full_state_dict(rank0_only=") + (rank0_only ? "true" : "false") + ")");
  const bool keep = !rank0_only || state.comm.rank() == 0;
  std::unordered_map<const c10::TensorImpl*, at::Tensor> full;
  for (auto& w : state.groups) {
    auto g = w.lock();
    if (!g) continue;
    // A unit left gathered by a forward whose backward never ran: back to its shards first (the
    // same on every rank, which ran the same forwards).
    g->reshard();
    std::vector<at::Tensor> gathered;
    g->gather_full(gathered, at::kCPU);
    if (!keep) continue;
    for (size_t i = 0; i < gathered.size(); ++i) full.emplace(g->slots()[i].param.unsafeGetTensorImpl(), gathered[i]);
  }
  torch::OrderedDict<std::string, at::Tensor> out;
  if (!keep) return out;
  for (const auto& kv : module_->named_parameters()) out.insert(kv.key(), full.at(kv.value().unsafeGetTensorImpl()));
  for (const auto& kv : module_->named_buffers()) {
    out.insert(kv.key(), kv.value().to(at::kCPU, kv.value().scalar_type(), false, /*copy=*/true));
  }
  return out;
}

void FSDPModule::mark_shards_written() {
  for (auto& w : root_->state().groups) {
    if (auto g = w.lock()) g->mark_shards_written();
  }
}

std::vector<UnitInfo> FSDPModule::units() const {
  std::vector<UnitInfo> out;
  size_t spec = 0;
  for (auto& w : root_->state().groups) {
    if (auto g = w.lock()) {
      UnitInfo u;
      u.name = g->name();
      u.strategy = g->strategy();
      u.shard_numel = g->shard_numel();
      u.shard_rank = g->shard_rank();
      u.shard_world_size = g->shard_world_size();
      u.unsharded = g->is_unsharded();
      u.param_dtype = g->param_dtype();
      u.reduce_dtype = g->reduce_dtype();
      for (const auto& s : g->slots()) {
        u.params.push_back(s.name);
        u.specs.push_back(spec++);
      }
      u.flat_shard = g->flat_shard();
      u.flat_grad = g->flat_grad();
      out.push_back(std::move(u));
    }
  }
  return out;
}

std::vector<ShardSpec> FSDPModule::shard_specs() const {
  const RunState& state = root_->state();
  const int rank = state.comm.rank();
  std::vector<ShardSpec> out;
  size_t unit = 0;
  for (const auto& w : state.groups) {
    auto g = w.lock();
    if (!g) continue;
    TORCH_CHECK(!g->is_unsharded(), "fsdp::shard_specs (", state.comm.where(), "): unit '",
                g->is_root() ? "<root>" : g->name(),
                "' is unsharded (inside its forward or backward); ask for the shard contract between steps.");
    const int S = static_cast<int>(g->shard_world_size());
    for (const auto& s : g->slots()) {
      ShardSpec p;
      p.name = s.name;
      p.global_shape = s.shape;
      p.dtype = s.sharded.scalar_type();
      p.strategy = g->strategy();
      p.unit = unit;
      p.layout = s.layout;
      p.shard_rank = static_cast<int>(g->shard_rank());
      p.shard_world_size = S;
      p.replica_rank = rank / S;
      p.replicas = static_cast<int>(g->replication());
      p.row_begin = s.layout.begin(p.shard_rank);
      p.row_end = s.layout.end(p.shard_rank);
      p.local = s.param;
      p.flat_offset = s.offset;
      out.push_back(std::move(p));
    }
    ++unit;
  }
  return out;
}

void FSDPModule::discard_unsynced_gradients() {
  TORCH_CHECK(!root_->state().in_backward(), "fsdp::discard_unsynced_gradients (", root_->state().comm.where(),
              "): called during backward; call it between steps.");
  for (auto& w : root_->state().groups) {
    if (auto g = w.lock()) g->drop_unsynced_grads();
  }
}

void FSDPModule::check_gradients_reduced(const char* caller) const {
  root_->state().check_no_unsynced_grads(caller);
}

void FSDPModule::all_reduce(at::Tensor& tensor, c10d::ReduceOp op, const std::string& what) const {
  RunState& state = root_->state();
  state.check_not_broken();
  // Every rank must be at this call: one rank reducing while another runs its next forward would
  // pair this all-reduce with a collective of another size.
  const auto name = static_cast<int64_t>(std::hash<std::string>{}(what) >> 1);
  state.check_boundary(RunState::Boundary::kModelCollective, name, tensor.numel(), what);
  state.comm.all_reduce(tensor, std::move(op), what);
}

void FSDPModule::zero_grad(bool set_to_none) {
  root_->state().check_no_unsynced_grads("model.zero_grad()");
  root_->state().wait_host_copies();  // offload: no gradient copy still writing what is zeroed
  module_->zero_grad(set_to_none);
}

void FSDPModule::set_requires_gradient_sync(bool sync) {
  root_->state().sync_gradients = sync;
}
bool FSDPModule::requires_gradient_sync() const {
  return root_->state().sync_gradients;
}

int64_t FSDPModule::num_parameters() const {
  int64_t n = 0;
  for (auto& w : root_->state().groups) {
    if (auto g = w.lock()) {
      for (const auto& s : g->slots()) n += s.layout.numel();
    }
  }
  return n;
}

const CommStats& FSDPModule::comm_stats() const {
  return root_->state().comm.stats();
}
int64_t FSDPModule::held_state_bytes() const {
  return root_->state().held_state_bytes();
}
BufferCacheStats FSDPModule::buffer_cache_stats() const {
  return root_->state().pool.stats();
}
void FSDPModule::release_cached_buffers() {
  root_->state().pool.release();
}
void FSDPModule::track_state_peak(bool on) {
  root_->state().track_state_peak(on);
}
int64_t FSDPModule::state_peak_bytes() const {
  return root_->state().state_peak();
}
void FSDPModule::reset_comm_stats() {
  root_->state().comm.stats() = CommStats{};
}
const c10::intrusive_ptr<c10d::ProcessGroup>& FSDPModule::process_group() const {
  return root_->state().comm.process_group();
}
const FullyShardOptions& FSDPModule::options() const {
  return root_->state().options;
}
int FSDPModule::rank() const {
  return root_->state().comm.rank();
}
int FSDPModule::world_size() const {
  return root_->state().comm.world_size();
}

bool FSDPModule::step_in_progress() const {
  const RunState& state = root_->state();
  if (state.in_root_forward || state.in_backward()) return true;
  for (const auto& w : state.groups) {
    if (auto g = w.lock(); g && g->backward_pending()) return true;
  }
  return false;
}

}  // namespace fsdp
