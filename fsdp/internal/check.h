// The library's checks: FSDP_CHECK is TORCH_CHECK throwing fsdp::Error (fsdp/error.h), so that
// "is this error ours?" is a type test (catch (const fsdp::Error&)), never a look at the text.
// FSDP_CHECK_IN also gives the context the error carries (the rank, operation, unit, group, peer).
// Internal to the library.
#pragma once

#include "fsdp/error.h"
#include "fsdp/export.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <string>

namespace fsdp::detail {

/// Who raises, as every message of the library that names its call begins, built from `context`
/// alone: "<api> (rank r)", "<api> (rank r of N)" (world_size set), "<api> (global rank r at
/// (dp_shard 1, tp 0) of mesh (dp_shard 2, tp 2))" (mesh set), "<api>" (rank not known).
FSDP_API std::string error_caller(const ErrorContext& context);

/// Throws fsdp::Error; a context without a rank gets this process's, where a process group made it
/// known. A context with an api() gets its message prefixed "<error_caller(context)>: ", so that
/// call sites write only what went wrong and what to do.
[[noreturn]] FSDP_API void throw_error(const c10::SourceLocation& source, std::string message,
                                       ErrorContext context = {});

}  // namespace fsdp::detail

#define FSDP_SOURCE_LOCATION                            \
  ::c10::SourceLocation {                               \
    __func__, __FILE__, static_cast<uint32_t>(__LINE__) \
  }

/// FSDP_CHECK(cond, message parts...): throws fsdp::Error with the parts joined (c10::str) unless cond.
#define FSDP_CHECK(cond, ...)                                                   \
  if (C10_UNLIKELY_OR_CONST(!(cond))) {                                         \
    ::fsdp::detail::throw_error(FSDP_SOURCE_LOCATION, ::c10::str(__VA_ARGS__)); \
  }

/// FSDP_CHECK_IN(context, cond, message parts...): the same, carrying `context` (an fsdp::ErrorContext);
/// with context.api() set, the message is "<api> (rank r of N): <parts>" (error_caller).
#define FSDP_CHECK_IN(context, cond, ...)                                                  \
  if (C10_UNLIKELY_OR_CONST(!(cond))) {                                                    \
    ::fsdp::detail::throw_error(FSDP_SOURCE_LOCATION, ::c10::str(__VA_ARGS__), (context)); \
  }
