#include "tp/group.h"

#include "fsdp/env.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"

namespace fsdp {
namespace detail {

Comm& tp_comm(const tp::Group& group) {
  return *group.comm_;
}

}  // namespace detail

namespace tp {

Group::Group(const DeviceMesh& mesh) {
  // Statistics and a call log of its own: this Group's (and its copies').
  comm_ = detail::mesh_group(mesh, kTensorDim, verify_collectives_from_env());
}

Group::Group(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  FSDP_CHECK(pg, "fsdp::tp::Group: the process group is null");
  detail::GroupInfo info;
  info.name = "tp group";
  comm_ = detail::own_group(pg, detail::group_timeout(*pg), info, verify_collectives_from_env());
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
