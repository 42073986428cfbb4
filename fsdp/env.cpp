#include "fsdp/env.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/env.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdlib>

namespace fsdp {
namespace detail {

const char* getenv_or_null(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

std::chrono::milliseconds parse_timeout_seconds(const std::string& value, const std::string& what) {
  // Decimal only ("20", "0.5", "1e3"), surrounding blanks allowed: no hex, no inf or nan.
  const size_t first = value.find_first_not_of(" \t");
  const size_t last = value.find_last_not_of(" \t");
  const std::string v = first == std::string::npos ? "" : value.substr(first, last - first + 1);
  constexpr double kMax = 365 * 86400.0;  // a year: beyond that, surely a typo
  char* end = nullptr;
  errno = 0;
  const double s =
      v.empty() || v.find_first_not_of("0123456789.eE+-") != std::string::npos ? -1.0 : std::strtod(v.c_str(), &end);
  const bool ok =
      errno == 0 && end != nullptr && end != v.c_str() && *end == '\0' && std::isfinite(s) && s > 0 && s <= kMax;
  FSDP_CHECK(ok, "fsdp: ", what, "='", value,
             "' is not a timeout: give a decimal number of seconds above 0 and at most 31536000 (a year), "
             "fractions allowed, e.g. ",
             what, "=60.");
  return std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(std::llround(s * 1000.0))));
}

std::string job_id() {
  if (const char* v = getenv_or_null("FSDP_JOB_ID")) return v;
  if (const char* v = getenv_or_null("TORCHELASTIC_RUN_ID")) return std::string("torchrun:") + v;
  if (const char* v = getenv_or_null("SLURM_JOB_ID")) {
    std::string id = std::string("slurm:") + v;
    if (const char* step = getenv_or_null("SLURM_STEP_ID")) id += std::string(".") + step;
    return id;
  }
  return "";
}

size_t parse_flight_recorder_size(const std::string& value, const std::string& what) {
  constexpr size_t kMax = 1000000;  // beyond that, surely a typo (each entry is a few hundred bytes)
  const bool digits = !value.empty() && value.size() <= 7 && value.find_first_not_of("0123456789") == std::string::npos;
  const size_t n = digits ? std::stoul(value) : kMax + 1;
  FSDP_CHECK(n <= kMax, "fsdp: ", what, "='", value,
             "' is not a flight recorder size: give the number of collectives to keep, a whole number from 0 (off) "
             "to 1000000, e.g. ",
             what, "=256.");
  return n;
}

size_t flight_recorder_size_from_env() {
  const char* v = getenv_or_null("FSDP_FLIGHT_RECORDER_SIZE");
  return v == nullptr ? 256 : parse_flight_recorder_size(v, "FSDP_FLIGHT_RECORDER_SIZE");
}

int parse_dump_signal(const std::string& value, const std::string& what) {
  std::string v = value;
  if (v.rfind("SIG", 0) == 0) v = v.substr(3);
  if (v == "USR1") return SIGUSR1;
  if (v == "USR2") return SIGUSR2;
  if (v == "0") return 0;
  // A real-time signal by number: free for applications. Others are refused: taking SIGTERM or
  // SIGINT would stop them from ending the process, and SIGKILL or SIGSTOP cannot be caught.
  const bool digits = !v.empty() && v.size() <= 3 && v.find_first_not_of("0123456789") == std::string::npos;
  const int n = digits ? std::stoi(v) : -1;
  if (n == SIGUSR1 || n == SIGUSR2 || (n >= SIGRTMIN && n <= SIGRTMAX)) return n;
  FSDP_CHECK(false, "fsdp: ", what, "='", value,
             "' is not a signal for the flight recorder's dump: give USR1 or USR2 (e.g. ", what,
             "=USR1, then `kill -USR1 <pid>` writes the file), a real-time signal's number (", SIGRTMIN, " to ",
             SIGRTMAX, "), or 0 for none.");
  return 0;
}

bool gloo_cuda_from_env() {
  const char* v = getenv_or_null("FSDP_TEST_GLOO_CUDA");
  if (v == nullptr) return false;
  const std::string s = v;
  FSDP_CHECK(s == "0" || s == "1", "fsdp: FSDP_TEST_GLOO_CUDA='", s,
             "' must be 1 (the testing mode: every local rank on cuda:0 over Gloo) or 0 (off); unset it to train "
             "normally. See docs/usage.md, 'Several ranks on one GPU'.");
  return s == "1";
}

int dump_signal_from_env() {
  const char* v = getenv_or_null("FSDP_DUMP_ON_SIGNAL");
  return v == nullptr ? 0 : parse_dump_signal(v, "FSDP_DUMP_ON_SIGNAL");
}

}  // namespace detail

std::chrono::milliseconds default_timeout() {
  const char* v = detail::getenv_or_null("FSDP_TIMEOUT");
  if (v == nullptr) return std::chrono::minutes(10);
  return detail::parse_timeout_seconds(v, "FSDP_TIMEOUT");
}

bool verify_collectives_from_env() {
  const char* v = detail::getenv_or_null("FSDP_VERIFY_COLLECTIVES");
  if (v == nullptr) return false;
  const std::string s = v;
  FSDP_CHECK(s == "0" || s == "1", "fsdp: FSDP_VERIFY_COLLECTIVES='", s, "' must be 1 (check) or 0 (off).");
  return s == "1";
}

}  // namespace fsdp
