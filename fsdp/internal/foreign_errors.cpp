#include "fsdp/internal/foreign_errors.h"

namespace fsdp::detail {

ForeignError recognize_foreign_error(const std::string& text) {
  // c10d's ProcessGroupGloo: WorkGloo::wait(timeout) when the collective did not end in time.
  if (text.rfind("Operation timed out!", 0) == 0) return ForeignError::kTimeout;
  // Gloo's tcp transport, when its own timeout (the group's, too) ends a send or a receive before
  // c10d's wait does (gloo/transport/tcp/unbound_buffer.cc): the same timeout, met first there.
  if (text.find("Timed out waiting ") != std::string::npos &&
      text.find(" operation to complete") != std::string::npos) {
    return ForeignError::kTimeout;
  }
  // Gloo's tcp transport (gloo/transport/tcp/pair.cc): a peer's message of another size, or a
  // preamble that does not match what this rank waits for.
  if (text.find("collective mismatch") != std::string::npos || text.find("preamble") != std::string::npos) {
    return ForeignError::kCollectiveMismatch;
  }
  return ForeignError::kOther;
}

}  // namespace fsdp::detail
