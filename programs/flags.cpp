#include "programs/flags.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <utility>

namespace fsdp::programs {

void usage_error(const std::string& what) {
  throw UsageError(what);
}

void bad_value(const std::string& flag, const std::string& value, const std::string& expected) {
  usage_error("bad value '" + value + "' for " + flag + ": expected " + expected);
}

int64_t parse_int(const std::string& flag, const std::string& v, int64_t lo, int64_t hi) {
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

std::vector<int64_t> parse_int_list(const std::string& flag, const std::string& v, int64_t lo, int64_t hi) {
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

uint64_t parse_uint64(const std::string& flag, const std::string& v) {
  const std::string expected = "a whole number from 0 to 18446744073709551615";
  if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos) bad_value(flag, v, expected);
  errno = 0;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(v.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') bad_value(flag, v, expected);
  return n;
}

double parse_double(const std::string& flag, const std::string& v, double lo, bool lo_inclusive, double hi) {
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

std::vector<std::string> parse_names(const std::string& flag, const std::string& v) {
  std::vector<std::string> out;
  for (size_t at = 0;;) {
    const size_t comma = v.find(',', at);
    out.push_back(v.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (out.back().empty()) bad_value(flag, v, "a comma-separated list of names");
    if (comma == std::string::npos) return out;
    at = comma + 1;
  }
}

namespace {

std::string number_text(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

std::string joined(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

}  // namespace

Flags::Flags(std::string program, std::string about) : program_(std::move(program)), about_(std::move(about)) {}

Flags& Flags::add(const std::string& name, const std::string& metavar, const std::string& help,
                  const std::string& default_text, std::function<void(const std::string&)> set) {
  for (last_ = 0; last_ < table_.size(); ++last_) {
    if (table_[last_].name == name) {  // a program's own take on a shared flag replaces it, in place
      table_[last_] = Flag{name, metavar, help, default_text, std::move(set)};
      return *this;
    }
  }
  table_.push_back(Flag{name, metavar, help, default_text, std::move(set)});
  return *this;
}

Flags& Flags::seed(const std::string& name, uint64_t& out, const std::string& help) {
  return add(name, "S", help, std::to_string(out), [&out, name](const std::string& v) { out = parse_uint64(name, v); });
}

Flags& Flags::number(const std::string& name, double& out, double lo, bool lo_inclusive, double hi,
                     const std::string& help, const std::string& metavar) {
  // No default shown for a value the flag refuses (0 for "unset": the program's own choice).
  const bool in_range = (lo_inclusive ? out >= lo : out > lo) && out <= hi;
  return add(
      name, metavar, help, in_range ? number_text(out) : "",
      [&out, name, lo, lo_inclusive, hi](const std::string& v) { out = parse_double(name, v, lo, lo_inclusive, hi); });
}

Flags& Flags::number(const std::string& name, std::optional<double>& out, double lo, bool lo_inclusive, double hi,
                     const std::string& help, const std::string& metavar) {
  return add(
      name, metavar, help, out ? number_text(*out) : "",
      [&out, name, lo, lo_inclusive, hi](const std::string& v) { out = parse_double(name, v, lo, lo_inclusive, hi); });
}

Flags& Flags::text(const std::string& name, std::string& out, const std::string& help, const std::string& metavar,
                   bool non_empty) {
  return add(name, metavar, help, out, [&out, name, non_empty](const std::string& v) {
    if (non_empty && v.empty()) bad_value(name, v, "a non-empty value");
    out = v;
  });
}

Flags& Flags::choice(const std::string& name, std::string& out, const std::vector<std::string>& choices,
                     const std::string& help) {
  return add(name, joined(choices, "|"), help, out, [&out, name, choices](const std::string& v) {
    for (const auto& c : choices) {
      if (v == c) {
        out = v;
        return;
      }
    }
    bad_value(name, v, joined(choices, ", "));
  });
}

Flags& Flags::toggle(const std::string& name, bool& out, const std::string& help, bool value) {
  return add(name, "", help, "", [&out, value](const std::string&) { out = value; });
}

Flags& Flags::names(const std::string& name, std::vector<std::string>& out, const std::string& help, bool* given) {
  return add(name, "A,B,...", help, joined(out, ","), [&out, name, given](const std::string& v) {
    out = parse_names(name, v);
    if (given != nullptr) *given = true;
  });
}

Flags& Flags::custom(const std::string& name, const std::string& metavar, const std::string& help,
                     std::function<void(const std::string&)> set) {
  return add(name, metavar, help, "", std::move(set));
}

Flags& Flags::hidden() {
  table_[last_].hidden = true;
  return *this;
}

Flags& Flags::positionals(const std::string& metavar, size_t min, size_t max) {
  positional_metavar_ = metavar;
  min_positionals_ = min;
  max_positionals_ = max;
  return *this;
}

Flags& Flags::notes(const std::string& text) {
  notes_ += text;
  return *this;
}

const Flags::Flag* Flags::find(const std::string& name) const {
  for (const auto& f : table_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

void Flags::answer_help(int argc, char** argv, int first) const {
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::cout << help();
      std::exit(0);
    }
  }
}

std::vector<std::string> Flags::parse(int argc, char** argv, int first) const {
  answer_help(argc, argv, first);
  std::vector<std::string> positionals;
  for (int i = first; i < argc; ++i) {
    std::string k = argv[i];
    std::optional<std::string> inline_value;
    if (k.rfind("--", 0) == 0 && k.find('=') != std::string::npos) {
      inline_value = k.substr(k.find('=') + 1);
      k = k.substr(0, k.find('='));
    }
    if (k.size() < 2 || k[0] != '-') {
      positionals.push_back(k);
      if (positionals.size() > max_positionals_) {
        usage_error(max_positionals_ == 0 ? "unexpected argument '" + k + "'"
                                          : "too many arguments ('" + k + "'); expected " + positional_metavar_);
      }
      continue;
    }
    const Flag* f = find(k);
    if (f == nullptr) usage_error("unknown flag '" + k + "'");
    const bool next_is_value = i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0;
    if (f->metavar.empty()) {  // a switch
      if (inline_value) usage_error(k + " takes no value");
      f->set("");
    } else if (inline_value) {
      f->set(*inline_value);
    } else if (f->optional_value) {
      f->set(next_is_value ? std::string(argv[++i]) : std::string());
    } else {
      if (!next_is_value) usage_error("missing value after " + k);
      f->set(argv[++i]);
    }
  }
  if (positionals.size() < min_positionals_) {
    usage_error(positional_metavar_.empty() ? "missing arguments" : "missing " + positional_metavar_);
  }
  return positionals;
}

std::string Flags::help() const {
  std::ostringstream out;
  out << "usage: " << program_ << (table_.empty() ? "" : " [flags]")
      << (positional_metavar_.empty() ? "" : " " + positional_metavar_) << "\n";
  if (!about_.empty()) out << about_ << (about_.back() == '\n' ? "" : "\n");
  size_t width = 0;
  for (const auto& f : table_) width = std::max(width, f.name.size() + (f.metavar.empty() ? 0 : f.metavar.size() + 1));
  width = std::min<size_t>(width, 30);
  for (const auto& f : table_) {
    if (f.hidden) continue;
    std::string left = f.name + (f.metavar.empty() ? "" : " " + f.metavar);
    if (left.size() < width) left.resize(width, ' ');
    out << "  " << left << "  " << f.help;
    if (!f.default_text.empty()) out << " (default " << f.default_text << ")";
    out << "\n";
  }
  if (!notes_.empty()) out << notes_ << (notes_.back() == '\n' ? "" : "\n");
  return out.str();
}

}  // namespace fsdp::programs
