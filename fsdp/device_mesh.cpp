#include "fsdp/device_mesh.h"

#include "fsdp/internal/check.h"
#include "fsdp/internal/mesh_state.h"
#include "fsdp/internal/subgroups.h"
#include "fsdp/process_group.h"

#include <ATen/ops/empty.h>

#include <random>
#include <set>
#include <sstream>

namespace fsdp {
namespace detail {
namespace {

std::string dims_text(const std::vector<MeshDim>& dims, const std::vector<int>* values = nullptr) {
  std::ostringstream os;
  os << "(";
  for (size_t d = 0; d < dims.size(); ++d)
    os << (d ? ", " : "") << dims[d].name << " " << (values ? (*values)[d] : dims[d].size);
  os << ")";
  return os.str();
}

// Global rank of the mesh point `coords` (row-major, the last dimension fastest).
int rank_at(const std::vector<MeshDim>& dims, const std::vector<int>& coords) {
  int r = 0;
  for (size_t d = 0; d < dims.size(); ++d) r = r * dims[d].size + coords[d];
  return r;
}

// "tp group (dp_shard 1)": the group along dims[along] named by the other coordinates.
std::string group_name(const std::string& name, const std::vector<MeshDim>& dims, const std::vector<int>& coords,
                       const std::set<std::string>& along) {
  std::ostringstream os;
  os << name << " group";
  bool first = true;
  for (size_t d = 0; d < dims.size(); ++d) {
    if (along.count(dims[d].name) != 0U) continue;
    os << (first ? " (" : ", ") << dims[d].name << " " << coords[d];
    first = false;
  }
  if (!first) os << ")";
  return os.str();
}

}  // namespace

int MeshState::index(const std::string& name) const {
  for (size_t d = 0; d < dims.size(); ++d) {
    if (dims[d].name == name) return static_cast<int>(d);
  }
  return -1;
}

const MeshGroup& MeshState::group(const std::string& name) const {
  auto it = groups.find(name);
  FSDP_CHECK_IN(ErrorContext().api("fsdp::DeviceMesh").rank(world->getRank()).mesh(where()), it != groups.end(),
                "no dimension '", name,
                "'; the mesh's are dp_replicate, dp_shard and tp, and 'dp' for both "
                "data-parallel dimensions flattened.");
  return it->second;
}

std::string MeshState::where() const {
  return dims_text(dims, &coordinates) + " of mesh " + dims_text(dims);
}

GroupInfo MeshState::group_info(const std::string& name) const {
  const MeshGroup& g = group(name);
  GroupInfo info;
  info.name = g.name;
  info.global_ranks = g.global_ranks;
  info.world_size = world->getSize();
  // A mesh over a group fsdp::new_subgroup made: its ranks by the job's global ranks.
  if (auto sub = subgroup_info(world.get())) {
    for (int& r : info.global_ranks) r = sub->global_ranks.at(static_cast<size_t>(r));
    info.world_size = sub->world_size;
  }
  info.mesh = where();
  return info;
}

const MeshState& mesh_state(const DeviceMesh& mesh) {
  return *mesh.state_;
}

}  // namespace detail

DeviceMesh::DeviceMesh(const c10::intrusive_ptr<c10d::ProcessGroup>& world, std::vector<MeshDim> dims)
    : state_(std::make_shared<detail::MeshState>()) {
  FSDP_CHECK(world, "fsdp::DeviceMesh: the world process group is null");
  const int rank = world->getRank();
  const int W = world->getSize();
  const std::string who = "fsdp::DeviceMesh (global rank " + std::to_string(rank) + " of " + std::to_string(W) + ")";
  FSDP_CHECK(!dims.empty(), who, ": a mesh needs at least one dimension, e.g. {{\"dp_shard\", ", W, "}}.");
  std::set<std::string> seen;
  int64_t product = 1;
  for (const MeshDim& d : dims) {
    FSDP_CHECK(d.name == kReplicateDim || d.name == kShardDim || d.name == kTensorDim || d.name == kPipeDim, who,
               ": unknown dimension '", d.name, "' in mesh ", detail::dims_text(dims),
               "; the library's dimensions are pp (pipeline parallel), dp_replicate (replicated data parallel), "
               "dp_shard (sharded data parallel) and tp (tensor parallel).");
    // The stages of a pipeline are the outermost blocks of ranks: a stage's (dp, tp) ranks are
    // consecutive, so that its collectives stay inside a node and only point-to-point crosses them.
    FSDP_CHECK(d.name != kPipeDim || &d == &dims.front(), who, ": dimension 'pp' of mesh ", detail::dims_text(dims),
               " is not the first; put it first (outermost), e.g. {{\"pp\", 2}, {\"dp_shard\", 2}, {\"tp\", 2}}.");
    FSDP_CHECK(seen.insert(d.name).second, who, ": dimension '", d.name, "' appears twice in mesh ",
               detail::dims_text(dims), ".");
    FSDP_CHECK(d.size >= 1, who, ": dimension '", d.name, "' of mesh ", detail::dims_text(dims), " has size ", d.size,
               "; sizes are at least 1.");
    product *= d.size;
  }
  FSDP_CHECK(product == W, who, ": mesh ", detail::dims_text(dims), " spans ", product, " rank(s), but the world has ",
             W, ". Choose sizes whose product is the world size (e.g. tp ", W > 1 ? 2 : 1, " and dp_shard ",
             W > 1 ? W / 2 : 1, " for ", W, " ranks when ", W, " is even).");
  detail::MeshState& s = *state_;
  s.world = world;
  s.dims = std::move(dims);
  s.timeout = detail::group_timeout(*world);
  int rest = rank;
  s.coordinates.assign(s.dims.size(), 0);
  for (size_t d = s.dims.size(); d-- > 0;) {
    s.coordinates[d] = rest % s.dims[d].size;
    rest /= s.dims[d].size;
  }

  // A fresh name per mesh for the subgroups' store keys: rank 0's random id, broadcast (as hybrid
  // sharding's groups; no process-wide counter that would have to agree between ranks).
  detail::Comm comm(world, s.timeout);
  detail::Fingerprint dims_print;
  for (const MeshDim& d : s.dims) dims_print.add(d.name).add(d.size);
  comm.agree(detail::Call::kDeviceMesh, dims_print.value(), "fsdp::DeviceMesh " + detail::dims_text(s.dims));
  at::Tensor id = at::empty({1}, at::kLong);
  id[0] = static_cast<int64_t>(std::random_device{}() >> 1) << 31 ^ static_cast<int64_t>(std::random_device{}());
  comm.broadcast(id, 0, "broadcast of the device mesh's name");
  const std::string prefix = "mesh-" + std::to_string(id.item<int64_t>()) + "/";

  // Every rank creates its group along each dimension in the order of the dimensions, then the
  // data-parallel one: the members of a group create it at the same point, so none waits for a
  // member busy creating another.
  auto make = [&](const std::string& name, const std::set<std::string>& along) {
    // The members: the mesh points that equal this rank's coordinates outside `along`, in row-major
    // order of the coordinates along it (for "dp": dp_replicate, then dp_shard).
    std::vector<int> members;
    std::vector<int> c = s.coordinates;
    std::vector<size_t> free;
    for (size_t d = 0; d < s.dims.size(); ++d) {
      if (along.count(s.dims[d].name) != 0U) free.push_back(d);
    }
    std::sort(free.begin(), free.end(), [&](size_t a, size_t b) {
      auto order = [](const std::string& n) { return n == kReplicateDim ? 0 : n == kShardDim ? 1 : 2; };
      return order(s.dims[a].name) < order(s.dims[b].name);
    });
    std::function<void(size_t)> walk = [&](size_t i) {
      if (i == free.size()) {
        members.push_back(detail::rank_at(s.dims, c));
        return;
      }
      for (int k = 0; k < s.dims[free[i]].size; ++k) {
        c[free[i]] = k;
        walk(i + 1);
      }
    };
    walk(0);
    const std::string label = detail::group_name(name, s.dims, s.coordinates, along);
    std::string key = prefix + name;
    for (int m : members) key += "." + std::to_string(m);
    detail::MeshGroup g{new_subgroup(world, members, key), members, label};
    s.groups[name] = std::move(g);
  };
  for (const MeshDim& d : s.dims) make(d.name, {d.name});
  const int R = size(kReplicateDim);
  const int S = size(kShardDim);
  if (R > 1 && S > 1) {
    make(kDataDim, {kReplicateDim, kShardDim});
  } else if (R > 1 || (S == 1 && has(kReplicateDim))) {
    s.groups[kDataDim] = s.groups[kReplicateDim];  // the data-parallel ranks are the replicate ones
  } else if (has(kShardDim)) {
    s.groups[kDataDim] = s.groups[kShardDim];
  }
  // A dimension the mesh lacks has size 1: one one-rank group serves all of them.
  const detail::MeshGroup* alone = nullptr;
  for (const char* name : {kDataDim, kReplicateDim, kShardDim, kTensorDim, kPipeDim}) {
    if (s.groups.count(name) != 0U) continue;
    if (alone == nullptr) {
      make(name, {});
      alone = &s.groups[name];
    } else {
      s.groups[name] = *alone;
    }
  }
}

const std::vector<MeshDim>& DeviceMesh::dims() const {
  return state_->dims;
}

bool DeviceMesh::has(const std::string& name) const {
  return state_->index(name) >= 0;
}

int DeviceMesh::size(const std::string& name) const {
  if (name == kDataDim) return size(kReplicateDim) * size(kShardDim);
  const int d = state_->index(name);
  return d < 0 ? 1 : state_->dims[d].size;
}

int DeviceMesh::coordinate(const std::string& name) const {
  if (name == kDataDim) return coordinate(kReplicateDim) * size(kShardDim) + coordinate(kShardDim);
  const int d = state_->index(name);
  return d < 0 ? 0 : state_->coordinates[d];
}

const c10::intrusive_ptr<c10d::ProcessGroup>& DeviceMesh::group(const std::string& name) const {
  return state_->group(name).pg;
}

const std::vector<int>& DeviceMesh::group_ranks(const std::string& name) const {
  return state_->group(name).global_ranks;
}

const c10::intrusive_ptr<c10d::ProcessGroup>& DeviceMesh::world() const {
  return state_->world;
}

int DeviceMesh::rank() const {
  return state_->world->getRank();
}

int DeviceMesh::world_size() const {
  return state_->world->getSize();
}

std::chrono::milliseconds DeviceMesh::timeout() const {
  return state_->timeout;
}

std::string DeviceMesh::shape_text() const {
  return detail::dims_text(state_->dims);
}

std::string DeviceMesh::coordinates_text() const {
  return detail::dims_text(state_->dims, &state_->coordinates);
}

}  // namespace fsdp
