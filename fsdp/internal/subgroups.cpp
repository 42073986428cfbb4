#include "fsdp/internal/subgroups.h"

#include <algorithm>
#include <mutex>
#include <utility>

namespace fsdp::detail {
namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10d::ProcessGroup> pg;
  GroupInfo info;
};

std::mutex& mu() {
  static std::mutex m;
  return m;
}
std::vector<Entry>& entries() {
  static std::vector<Entry> e;
  return e;
}

}  // namespace

void remember_subgroup(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::string& name,
                       std::vector<int> global_ranks, int world_size) {
  std::lock_guard<std::mutex> lock(mu());
  auto& e = entries();
  // Groups freed since are dropped here, so the list holds the live ones (a job makes a few).
  e.erase(std::remove_if(e.begin(), e.end(), [](const Entry& x) { return x.pg.expired(); }), e.end());
  GroupInfo info;
  info.name = "subgroup '" + name + "'";
  info.global_ranks = std::move(global_ranks);
  info.world_size = world_size;
  e.push_back({c10::weak_intrusive_ptr<c10d::ProcessGroup>(pg), std::move(info)});
}

std::optional<GroupInfo> subgroup_info(const c10d::ProcessGroup* pg) {
  std::lock_guard<std::mutex> lock(mu());
  for (const Entry& x : entries()) {
    const auto live = x.pg.lock();
    if (live && live.get() == pg) return x.info;
  }
  return std::nullopt;
}

}  // namespace fsdp::detail
