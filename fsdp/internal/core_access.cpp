// The door of the libraries around the core (fsdp/internal/core_access.h): each function is the
// run state's, reached through the handle, so that no library outside fsdp/ names RunState.
#include "fsdp/internal/core_access.h"

#include "fsdp/internal/access.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/mesh_state.h"
#include "fsdp/internal/run_state.h"

namespace fsdp::detail {

std::vector<int64_t> agree(const FSDPModule& model, Call call, uint64_t payload, const std::string& what,
                           int64_t vote) {
  RunState& state = Access::state(model);
  state.check_not_broken();
  return state.agree(call, Fingerprint().add(payload), what, vote);
}

void all_reduce(const FSDPModule& model, at::Tensor& tensor, c10d::ReduceOp op, const std::string& what, Span span) {
  // Every rank must be at this call: one rank reducing while another runs its next forward would
  // pair this all-reduce with a collective of another size.
  agree(model, Call::kModelCollective, Comm::reduction_fingerprint(tensor, op, what), what);
  RunState& state = Access::state(model);
  state.breaks_on_failure([&] {
    (span == Span::kStep ? state.step_comm() : state.comm()).all_reduce(tensor, op, what);
    // Tensor parallel: the data-parallel result, then over the parts (every rank of the mesh).
    if (Comm* tp = state.tp_comm()) tp->all_reduce(tensor, op, what + " over the tensor-parallel ranks");
  });
}

void breaks_on_failure(const FSDPModule& model, const std::function<void()>& fn) {
  Access::state(model).breaks_on_failure(fn);
}

void mark_broken(const FSDPModule& model, const std::string& why, const std::string& remedy) {
  Access::state(model).mark_broken(why, remedy);
}

const Comm& model_group(const FSDPModule& model) {
  return Access::state(model).comm();
}

std::shared_ptr<Comm> checkpoint_group(const FSDPModule& model) {
  RunState& state = Access::state(model);
  // Aliasing the run state: the group lives as long as the model's state does.
  return {state.shared_from_this(), state.mesh_comm() != nullptr ? state.mesh_comm() : &state.comm()};
}

bool checkpoint_wider_than_step(const FSDPModule& model) {
  const RunState& state = Access::state(model);
  return state.mesh_comm() != nullptr || state.replicas_apart();
}

const Comm* tensor_parallel_group(const FSDPModule& model) {
  return Access::state(model).tp_comm();
}

std::shared_ptr<Comm> mesh_group(const DeviceMesh& mesh, const std::string& dim, bool verify) {
  const MeshState& s = mesh_state(mesh);
  return own_group(s.group(dim).pg, s.timeout, s.group_info(dim), verify);
}

std::shared_ptr<Comm> own_group(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, std::chrono::milliseconds timeout,
                                GroupInfo info, bool verify) {
  // A CommShared of its own: its statistics and call log are this group's (and its copies').
  return std::make_shared<Comm>(pg, timeout, std::make_shared<CommShared>(), std::move(info), verify);
}

bool replicas_apart(const FSDPModule& model) {
  return Access::state(model).replicas_apart();
}

std::shared_ptr<OuterState> outer_state(const FSDPModule& model) {
  return Access::state(model).outer().lock();
}

void set_outer_state(const FSDPModule& model, const std::weak_ptr<OuterState>& outer) {
  Access::state(model).set_outer(outer);
}

void check_gradients_reduced(const FSDPModule& model, const char* caller) {
  Access::state(model).check_no_unsynced_grads(caller);
}

void gradients_rescaled(const FSDPModule& model) {
  Access::state(model).watch().rescaled_by_library();
}

}  // namespace fsdp::detail
