#include "fsdp/error.h"

#include "fsdp/internal/check.h"
#include "fsdp/process_group.h"

#include <utility>

namespace fsdp {

Error::Error(const c10::SourceLocation& source, std::string message, ErrorContext context)
    : c10::Error(source, std::move(message)), context_(std::move(context)) {}

std::string error_text(const std::exception_ptr& error) {
  if (!error) return "no error";
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return error_text(e);
  } catch (...) {
    return "an unknown exception";
  }
}

std::string error_text(const std::exception& error) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&error)) return c->what_without_backtrace();
  return error.what();
}

namespace detail {

std::string error_caller(const ErrorContext& context) {
  std::string text = context.api();
  if (context.rank() < 0) return text;
  if (!context.mesh().empty()) {
    text += c10::str(" (global rank ", context.rank(), " at ", context.mesh());
  } else {
    text += c10::str(" (rank ", context.rank());
    if (context.world_size() > 0) text += c10::str(" of ", context.world_size());
  }
  if (!context.path().empty()) text += ", '" + context.path() + "'";
  return text + ")";
}

void throw_error(const c10::SourceLocation& source, std::string message, ErrorContext context) {
  // This process's rank once a process group was made here (a simulated rank's is not known).
  if (context.rank() < 0 && !launch_env().launcher.empty()) context.rank(launch_env().rank);
  if (!context.api().empty()) message = error_caller(context) + ": " + message;
  throw Error(source, std::move(message), std::move(context));
}

}  // namespace detail
}  // namespace fsdp
