#include "tp/group.h"

#include "fsdp/env.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/comm.h"
#include "fsdp/internal/mesh_state.h"

namespace fsdp {
namespace detail {

Comm& tp_comm(const tp::Group& group) {
  return *group.comm_;
}

}  // namespace detail

namespace tp {

Group::Group(const DeviceMesh& mesh) {
  const detail::MeshState& s = detail::mesh_state(mesh);
  // A CommShared of its own: its statistics and call log are this Group's (and its copies').
  comm_ = std::make_shared<detail::Comm>(s.group(kTensorDim).pg, s.timeout, std::make_shared<detail::CommShared>(),
                                         s.group_info(kTensorDim), verify_collectives_from_env());
}

Group::Group(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  FSDP_CHECK(pg, "fsdp::tp::Group: the process group is null");
  detail::GroupInfo info;
  info.name = "tp group";
  comm_ = std::make_shared<detail::Comm>(pg, detail::group_timeout(*pg), std::make_shared<detail::CommShared>(), info,
                                         verify_collectives_from_env());
}

int Group::rank() const {
  return comm_->rank();
}

int Group::size() const {
  return comm_->world_size();
}

std::vector<int> Group::global_ranks() const {
  return comm_->global_ranks();
}

std::string Group::where() const {
  return comm_->where();
}

const CommStats& Group::comm_stats() const {
  return comm_->stats();
}

void Group::reset_comm_stats() {
  comm_->stats() = CommStats{};
  comm_->log().reset();
}

}  // namespace tp
}  // namespace fsdp
