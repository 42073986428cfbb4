#include "checkpoint/internal/crash_point.h"

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <string>

namespace fsdp::checkpoint::detail {

void crash_point(const char* point, int rank) {
  static const std::string at = [] {
    const char* v = std::getenv("FSDP_CHECKPOINT_CRASH_AT");
    return std::string(v != nullptr ? v : "");
  }();
  if (at.empty()) return;
  const std::string here = std::string(point) + "@" + std::to_string(rank);
  if (at == here) std::raise(SIGKILL);
}

int injected_write_error(const std::string& path) {
  static const std::string spec = [] {
    const char* v = std::getenv("FSDP_CHECKPOINT_FAIL_WRITE");
    return std::string(v != nullptr ? v : "");
  }();
  const auto colon = spec.find(':');
  if (colon == std::string::npos || path.find(spec.substr(colon + 1)) == std::string::npos) return 0;
  const std::string code = spec.substr(0, colon);
  return code == "ENOSPC" ? ENOSPC : code == "EIO" ? EIO : 0;
}

}  // namespace fsdp::checkpoint::detail
