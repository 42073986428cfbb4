// Command-line helpers shared by train_gpt and the benchmarks: strict number parsing (the whole
// string, a range, finite), the exit statuses, and JSON numbers that stay JSON when they are not finite.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace cli {

/// A bad command line or input file: the program prints it and exits with kUsageExit.
/// `show_usage`: also print the flags (a flag error, not a file error).
struct InputError : std::runtime_error {
  InputError(const std::string& what, bool show_usage) : std::runtime_error(what), show_usage(show_usage) {}
  bool show_usage;
};

constexpr int kUsageExit = 2;  // a bad flag or input (as argparse and most Unix tools)
constexpr int kErrorExit = 1;  // anything else that went wrong

[[noreturn]] inline void bad_value(const std::string& flag, const std::string& value, const std::string& expected) {
  throw InputError("bad value '" + value + "' for " + flag + ": expected " + expected, true);
}

/// A whole decimal integer in [lo, hi]: no sign where lo >= 0, no trailing characters, no overflow.
inline int64_t parse_int(const std::string& flag, const std::string& v, int64_t lo,
                         int64_t hi = std::numeric_limits<int64_t>::max()) {
  const std::string expected = hi == std::numeric_limits<int64_t>::max()
                                   ? "a whole number >= " + std::to_string(lo)
                                   : "a whole number from " + std::to_string(lo) + " to " + std::to_string(hi);
  const bool digits =
      !v.empty() && v.find_first_not_of("0123456789", v[0] == '-' ? 1 : 0) == std::string::npos && v != "-";
  if (!digits) bad_value(flag, v, expected);
  errno = 0;
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || n < lo || n > hi) bad_value(flag, v, expected);
  return n;
}

/// A comma-separated list of whole numbers, each as parse_int takes it ("1,2,4"); never empty, no
/// empty item.
inline std::vector<int64_t> parse_int_list(const std::string& flag, const std::string& v, int64_t lo,
                                           int64_t hi = std::numeric_limits<int64_t>::max()) {
  std::vector<int64_t> out;
  for (size_t at = 0;;) {
    const size_t comma = v.find(',', at);
    const std::string item = v.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    if (item.empty()) bad_value(flag, v, "a comma-separated list of whole numbers");
    out.push_back(parse_int(flag, item, lo, hi));
    if (comma == std::string::npos) return out;
    at = comma + 1;
  }
}

/// A whole non-negative decimal integer up to 2^64 - 1 (a seed).
inline uint64_t parse_uint64(const std::string& flag, const std::string& v) {
  const std::string expected = "a whole number from 0 to 18446744073709551615";
  if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos) bad_value(flag, v, expected);
  errno = 0;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(v.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') bad_value(flag, v, expected);
  return n;
}

/// A finite number (decimal or exponent notation) above `lo` (or at it, with `lo_inclusive`) and
/// at most `hi`. "nan", "inf" and trailing characters are refused.
inline double parse_double(const std::string& flag, const std::string& v, double lo, bool lo_inclusive,
                           double hi = std::numeric_limits<double>::max()) {
  std::string expected = std::string("a finite number ") + (lo_inclusive ? ">= " : "> ");
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.10g", lo);
  expected += buf;
  if (hi < std::numeric_limits<double>::max()) {
    std::snprintf(buf, sizeof(buf), "%.10g", hi);
    expected += std::string(" and <= ") + buf;
  }
  const bool plain = !v.empty() && v.find_first_not_of("0123456789.eE+-") == std::string::npos;
  if (!plain) bad_value(flag, v, expected);  // refuses nan, inf, hex floats, spaces
  errno = 0;
  char* end = nullptr;
  const double d = std::strtod(v.c_str(), &end);
  const bool in_range = std::isfinite(d) && (lo_inclusive ? d >= lo : d > lo) && d <= hi;
  if (errno != 0 || end == v.c_str() || *end != '\0' || !in_range) bad_value(flag, v, expected);
  return d;
}

/// `v` in printf's `format` (e.g. "%.9g"), or null when it is NaN or infinite: JSON has no token
/// for them, and `json.loads` in strict mode (or any other parser) refuses "nan".
inline std::string json_number(double v, const char* format = "%.9g") {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, v);
  return buf;
}

/// `s` as a JSON string literal (quotes, backslashes and control characters escaped).
inline std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

/// `what` without C++ backtraces: an error that wraps another (c10d's, say) may carry the inner
/// one's "Exception raised from ..." block of frames; the user needs the message, not the frames.
inline std::string without_backtrace(const std::string& what) {
  std::istringstream in(what);
  std::string line, out;
  bool frames = false;
  while (std::getline(in, line)) {
    if (line.rfind("Exception raised from ", 0) == 0) {
      frames = true;
      continue;
    }
    if (frames && (line.rfind("frame #", 0) == 0 || line.empty())) continue;
    frames = false;
    out += (out.empty() ? "" : "\n") + line;
  }
  return out;
}

}  // namespace cli
