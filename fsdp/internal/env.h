// The library's own helpers for reading the environment (the variables are listed in fsdp/env.h).
#pragma once

#include "fsdp/env.h"

#include <chrono>
#include <string>

namespace fsdp::detail {

/// The variable's value, or null when it is unset or empty (an empty variable counts as unset).
const char* getenv_or_null(const char* name);

/// This job's identity (see above); "" when the launcher gave none.
std::string job_id();

/// Parses a timeout in seconds ("20", "0.5") from `what` (a flag or variable name, for messages).
std::chrono::milliseconds parse_timeout_seconds(const std::string& value, const std::string& what);

}  // namespace fsdp::detail
