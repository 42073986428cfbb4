#include "fsdp/fully_shard.h"

#include "fsdp/internal/access.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/mesh_state.h"
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
  const std::shared_ptr<RunState>& state = detail::Access::state(scope);
  FSDP_CHECK(state != nullptr, "fsdp::fully_shard: the ShardingScope has no state");
  FSDP_CHECK_IN(state->comm().error_in("fsdp::fully_shard"), state->units().empty(),
                "this ShardingScope already wrapped a model; open one scope per model.");
  scope.close();
  root_ = shard_model(module_, scope.process_group(), state->options(), state);
  reset_comm_stats();
}

namespace detail {

FullyShardOptions options_for_mesh(const DeviceMesh& mesh, FullyShardOptions options) {
  const int R = mesh.size(kReplicateDim), S = mesh.size(kShardDim);
  // A stage's FSDP spans its own (dp, tp) ranks, never pp: the library's agreements at every
  // forward and backward would block a stage in a collective while its neighbour waits on a
  // receive. Until fsdp::pp composes with FSDP that way, a mesh with pipeline stages is refused.
  FSDP_CHECK_IN(ErrorContext()
                    .api("fsdp::fully_shard")
                    .rank(mesh.rank())
                    .mesh(mesh.coordinates_text() + " of mesh " + mesh.shape_text()),
                mesh.size(kPipeDim) == 1, "mesh ", mesh.shape_text(), " has ", mesh.size(kPipeDim),
                " pipeline stages (pp): a model wrapped across stages would block a stage in its agreements while "
                "its neighbour waits on a transfer. Wrap each stage's model over its own stage's ranks, "
                "fsdp::pp::stage_mesh(mesh) (docs/pipeline.md).");
  if (R > 1 && S > 1) {
    const ShardingStrategy s = options.strategy();
    const ErrorContext context = ErrorContext()
                                     .api("fsdp::fully_shard")
                                     .rank(mesh.rank())
                                     .mesh(mesh.coordinates_text() + " of mesh " + mesh.shape_text());
    FSDP_CHECK_IN(context, s == ShardingStrategy::kFullShard || s == ShardingStrategy::kHybridShard,
                  "a mesh with dp_replicate ", R, " and dp_shard ", S,
                  " means hybrid sharding, but the options ask for ", to_string(s),
                  ". Use kFullShard or kHybridShard with this mesh, or a mesh with one data-parallel dimension.");
    FSDP_CHECK_IN(context, options.shard_group_size() == 0 || options.shard_group_size() == S, "shard_group_size is ",
                  options.shard_group_size(), ", but the mesh's dp_shard dimension has ", S,
                  " ranks. Leave shard_group_size unset with a mesh: its dp_shard size is the group size.");
    options.strategy(ShardingStrategy::kHybridShard).shard_group_size(S);
  }
  return options;
}

}  // namespace detail

FSDPModule::FSDPModule(std::shared_ptr<torch::nn::Module> module, const DeviceMesh& mesh,
                       const FullyShardOptions& options)
    : module_(std::move(module)),
      root_(shard_model(module_, mesh.group(kDataDim), detail::options_for_mesh(mesh, options), nullptr,
                        &detail::mesh_state(mesh))) {
  reset_comm_stats();
}

detail::ForwardCasts FSDPModule::root_pre_forward() {
  root_->state().begin_forward();
  root_->state().in_root_forward() = true;
  root_->pre_forward();
  detail::ForwardCasts casts;
  casts.input = root_->input_cast();
  casts.output = root_->output_cast();
  casts.compute = root_->param_dtype();
  return casts;
}

void FSDPModule::root_post_forward(const std::vector<at::Tensor>& outputs) {
  root_->post_forward(outputs);
  root_->state().end_forward();
}

void FSDPModule::root_forward_ended() {
  root_->state().in_root_forward() = false;
}

void FSDPModule::begin_access() const {
  ++root_->state().direct_access();
}
void FSDPModule::end_access(bool threw) const {
  RunState& state = root_->state();
  --state.direct_access();
  // Between steps the module's parameters are shards: a forward called on the module itself
  // (model->forward(x)) fails in its first operation that needs a full shape, with an error that
  // says nothing of the wrapper. Said here, as the error leaves the call.
  const bool refused = std::exchange(state.access_error_explained(), false);
  if (threw && !refused && state.direct_access() == 0 && !state.in_root_forward()) {
    TORCH_WARN(detail::error_caller(state.comm().error_in("fsdp")),
               ": an error left a call through the handle's operator->. If that call was the module's own "
               "forward (model->forward(x)) or a unit's Impl::forward (model->h0->BlockImpl::forward(x)), it ran "
               "around the wrapper on this rank's shards; call the handle itself: model(x) or model.forward(x), "
               "and a unit as block(x) or block->forward(x).");
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
  state.for_each_unit([&](const detail::Unit& u) { u.check_conversion(device, dtype, /*converting=*/false); });
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
  FSDP_CHECK_IN(state.comm().error_in("fsdp::full_state_dict"), !state.in_backward(),
                "called during backward; call it between steps.");
  state.agree(detail::Call::kFullStateDict, detail::Fingerprint().add(rank0_only ? 1 : 0),
              std::string("full_state_dict(rank0_only=") + (rank0_only ? "true" : "false") + ")");
  const bool keep = !rank0_only || state.comm().rank() == 0;
  std::unordered_map<const c10::TensorImpl*, at::Tensor> full;
  state.for_each_unit([&](detail::Unit& u) {
    // A unit left gathered by a forward whose backward never ran: back to its shards first (the
    // same on every rank, which ran the same forwards).
    u.reshard();
    std::vector<at::Tensor> gathered;
    u.gather_full(gathered, at::kCPU);
    if (!keep) return;
    for (size_t i = 0; i < gathered.size(); ++i) full.emplace(u.slots()[i].param.unsafeGetTensorImpl(), gathered[i]);
  });
  torch::OrderedDict<std::string, at::Tensor> out;
  if (!keep) return out;
  for (const auto& kv : module_->named_parameters()) out.insert(kv.key(), full.at(kv.value().unsafeGetTensorImpl()));
  for (const auto& kv : module_->named_buffers()) {
    out.insert(kv.key(), kv.value().to(at::kCPU, kv.value().scalar_type(), false, /*copy=*/true));
  }
  return out;
}

void FSDPModule::mark_shards_written() {
  root_->state().for_each_unit([](detail::Unit& u) { u.mark_shards_written(); });
}

std::vector<UnitInfo> FSDPModule::units() const {
  std::vector<UnitInfo> out;
  size_t spec = 0;
  root_->state().for_each_unit([&](const detail::Unit& g) {
    UnitInfo u;
    u.name = g.name();
    u.strategy = g.strategy();
    u.shard_numel = g.shard_numel();
    u.shard_rank = g.shard_rank();
    u.shard_world_size = g.shard_world_size();
    u.unsharded = g.is_unsharded();
    u.param_dtype = g.param_dtype();
    u.reduce_dtype = g.reduce_dtype();
    for (const auto& s : g.slots()) {
      u.params.push_back(s.name);
      u.specs.push_back(spec++);
    }
    u.flat_shard = g.flat_shard();
    u.flat_grad = g.flat_grad();
    out.push_back(std::move(u));
  });
  return out;
}

std::vector<ShardSpec> FSDPModule::shard_specs() const {
  const RunState& state = root_->state();
  const int rank = state.comm().rank();
  std::vector<ShardSpec> out;
  size_t unit = 0;
  state.for_each_unit([&](const detail::Unit& g) {
    FSDP_CHECK_IN(g.error_in("fsdp::shard_specs"), !g.is_unsharded(), "unit '", g.label(),
                  "' is unsharded (inside its forward or backward); ask for the shard contract between steps. (A "
                  "backward that threw leaves its units so until the next forward of the model, which clears what it "
                  "left: run one, or restart from the last checkpoint.)");
    const int S = static_cast<int>(g.shard_world_size());
    for (const auto& s : g.slots()) {
      ShardSpec p;
      p.name = s.name;
      p.global_shape = s.shape;
      p.dtype = s.sharded.scalar_type();
      p.strategy = g.strategy();
      p.unit = unit;
      p.layout = s.layout;
      p.shard_rank = static_cast<int>(g.shard_rank());
      p.shard_world_size = S;
      p.replica_rank = rank / S;
      p.replicas = static_cast<int>(g.replication());
      p.row_begin = s.layout.begin(p.shard_rank);
      p.row_end = s.layout.end(p.shard_rank);
      p.local = s.param;
      p.flat_offset = s.offset;
      const auto split = state.tp_splits().find(s.param.unsafeGetTensorImpl());
      if (split != state.tp_splits().end()) p.tp = split->second;
      p.tp_size = state.tp_size();
      p.tp_rank = state.tp_comm() ? state.tp_comm()->rank() : 0;
      out.push_back(std::move(p));
    }
    ++unit;
  });
  return out;
}

void FSDPModule::discard_unsynced_gradients() {
  FSDP_CHECK_IN(root_->state().comm().error_in("fsdp::discard_unsynced_gradients"), !root_->state().in_backward(),
                "called during backward; call it between steps.");
  root_->state().for_each_unit([](detail::Unit& u) { u.drop_unsynced_grads(); });
}

void FSDPModule::zero_grad(bool set_to_none) {
  root_->state().check_no_unsynced_grads("model.zero_grad()");
  root_->state().wait_host_copies();  // offload: no gradient copy still writing what is zeroed
  module_->zero_grad(set_to_none);
}

void FSDPModule::set_requires_gradient_sync(bool sync) {
  root_->state().set_sync_gradients(sync);
}
bool FSDPModule::requires_gradient_sync() const {
  return root_->state().sync_gradients();
}
void FSDPModule::set_reshard_after_forward(bool on) {
  root_->state().set_reshard_after_forward(on);
}
void FSDPModule::set_reshard_after_backward(bool on) {
  root_->state().set_reshard_after_backward(on);
}
void FSDPModule::unshard() {
  root_->state().unshard_all("fsdp::FSDPModule::unshard");
}
void FSDPModule::reshard() {
  root_->state().reshard_all("fsdp::FSDPModule::reshard");
}
void FSDPModule::reduce_gradients() {
  root_->state().reduce_gradients();
}

int64_t FSDPModule::num_parameters() const {
  int64_t n = 0;
  const RunState& state = root_->state();
  state.for_each_unit([&](const detail::Unit& u) {
    for (const auto& s : u.slots()) {
      // Tensor parallel: this rank holds one part of a split parameter; the model has them all.
      const auto split = state.tp_splits().find(s.param.unsafeGetTensorImpl());
      n += s.layout.numel() * (split != state.tp_splits().end() && split->second.split() ? split->second.parts : 1);
    }
  });
  return n;
}

const CommStats& FSDPModule::comm_stats() const {
  return root_->state().comm().stats();
}
int64_t FSDPModule::held_state_bytes() const {
  return root_->state().held_state_bytes();
}
BufferCacheStats FSDPModule::buffer_cache_stats() const {
  return root_->state().pool().stats();
}
void FSDPModule::release_cached_buffers() {
  root_->state().pool().release();
}
void FSDPModule::track_state_peak(bool on) {
  root_->state().track_state_peak(on);
}
int64_t FSDPModule::state_peak_bytes() const {
  return root_->state().state_peak();
}
void FSDPModule::reset_comm_stats() {
  root_->state().comm().stats() = CommStats{};
}
const c10::intrusive_ptr<c10d::ProcessGroup>& FSDPModule::process_group() const {
  return root_->state().comm().process_group();
}
const FullyShardOptions& FSDPModule::options() const {
  return root_->state().options();
}
int FSDPModule::rank() const {
  return root_->state().comm().rank();
}
int FSDPModule::world_size() const {
  return root_->state().comm().world_size();
}

bool FSDPModule::step_in_progress() const {
  const RunState& state = root_->state();
  if (state.in_root_forward() || state.in_backward()) return true;
  bool pending = false;
  state.for_each_unit([&](const detail::Unit& u) { pending = pending || u.backward_pending(); });
  return pending;
}

namespace detail {

RunState& Access::state(const FSDPModule& model) {
  return model.root_->state();
}

}  // namespace detail
}  // namespace fsdp
