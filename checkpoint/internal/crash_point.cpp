#include "checkpoint/internal/crash_point.h"
#include "fsdp/internal/check.h"

#include <c10/util/Exception.h>

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
  // "<point>@<rank>" dies there (SIGKILL); "<point>@<rank>:stop" stops there (SIGSTOP), as a
  // process that hangs: its peers must fail within their timeout.
  const std::string here = std::string(point) + "@" + std::to_string(rank);
  if (at == here) std::raise(SIGKILL);
  if (at == here + ":stop") std::raise(SIGSTOP);
}

int injected_write_error(const std::string& path) {
  static const std::string spec = [] {
    const char* v = std::getenv("FSDP_CHECKPOINT_FAIL_WRITE");
    return std::string(v != nullptr ? v : "");
  }();
  if (spec.empty()) return 0;
  const auto colon = spec.find(':');
  const std::string code = spec.substr(0, colon);
  FSDP_CHECK(colon != std::string::npos && (code == "ENOSPC" || code == "EIO"), "FSDP_CHECKPOINT_FAIL_WRITE='", spec,
             "' is malformed: write ENOSPC:TEXT or EIO:TEXT (a testing hook; unset it otherwise).");
  if (path.find(spec.substr(colon + 1)) == std::string::npos) return 0;
  return code == "ENOSPC" ? ENOSPC : EIO;
}

}  // namespace fsdp::checkpoint::detail
