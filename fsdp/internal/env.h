// The library's own helpers for reading the environment (the variables are listed in fsdp/env.h).
#pragma once

#include "fsdp/env.h"
#include "fsdp/export.h"

#include <chrono>
#include <string>

namespace fsdp::detail {

/// The variable's value, or null when it is unset or empty (an empty variable counts as unset).
const char* getenv_or_null(const char* name);

/// This job's identity (see above); "" when the launcher gave none.
std::string job_id();

/// Parses a timeout in seconds ("20", "0.5") from `what` (a flag or variable name, for messages).
std::chrono::milliseconds parse_timeout_seconds(const std::string& value, const std::string& what);

/// $FSDP_FLIGHT_RECORDER_SIZE: the flight recorder's ring size (0: off), default 256.
FSDP_TESTING_API size_t flight_recorder_size_from_env();
/// Parses a ring size ("0" to "1000000") from variable `what`.
FSDP_TESTING_API size_t parse_flight_recorder_size(const std::string& value, const std::string& what);

/// $FSDP_TEST_GLOO_CUDA: the testing mode of several ranks on one GPU over Gloo.
FSDP_TESTING_API bool gloo_cuda_from_env();

/// $FSDP_DUMP_ON_SIGNAL: the signal whose receipt writes the flight recorder's file (0: none).
int dump_signal_from_env();
/// Parses "USR1", "SIGUSR1", "USR2", "SIGUSR2", a real-time signal's number, or "0" (none).
FSDP_TESTING_API int parse_dump_signal(const std::string& value, const std::string& what);

}  // namespace fsdp::detail
