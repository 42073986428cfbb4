// The one command-line parser of the programs around the library (examples, benchmarks, tools): a
// table of flags with typed, checked values, the --help text generated from that table, and one
// usage error for everything wrong on a command line.
//
//   fsdp::programs::Flags flags("fused_adamw_bench", "FusedAdamW against torch::optim::AdamW ...");
//   flags.integer("--steps", steps, 1, 1000000, "optimizer steps per round");
//   flags.toggle("--json", json, "JSON rows on stdout");
//   flags.parse(argc, argv);  // --help: the text on stdout, exit 0; a bad flag: a UsageError
//
// A value is the next argument, never the next flag (a negative number has one dash); --flag=value
// is taken too. A usage error is thrown as UsageError and printed by programs/program.h's main as
//   <program>: <what is wrong>; see <program> --help
// with exit status 2.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp::programs {

constexpr int kUsageExit = 2;  ///< a bad flag or input (as argparse and most Unix tools)
constexpr int kErrorExit = 1;  ///< anything else that went wrong

/// A bad command line (`see_help`: the message ends with "; see <program> --help"), or a bad input
/// file named on it (no pointer to --help: the flags were right). Exit status kUsageExit.
struct UsageError : std::runtime_error {
  explicit UsageError(const std::string& what, bool see_help = true) : std::runtime_error(what), see_help(see_help) {}
  bool see_help;
};

/// Throws the UsageError of a command line.
[[noreturn]] void usage_error(const std::string& what);

/// Throws "bad value 'V' for FLAG: expected EXPECTED".
[[noreturn]] void bad_value(const std::string& flag, const std::string& value, const std::string& expected);

// The strict value parsers the table uses (and a program may use for its own checks): the whole
// string, in range, finite; each throws bad_value naming the flag.

/// A whole decimal integer in [lo, hi]: no sign where lo >= 0, no trailing characters, no overflow.
int64_t parse_int(const std::string& flag, const std::string& v, int64_t lo,
                  int64_t hi = std::numeric_limits<int64_t>::max());
/// A comma-separated list of parse_int's numbers ("1,2,4"); never empty, no empty item.
std::vector<int64_t> parse_int_list(const std::string& flag, const std::string& v, int64_t lo,
                                    int64_t hi = std::numeric_limits<int64_t>::max());
/// A whole non-negative decimal integer up to 2^64 - 1 (a seed).
uint64_t parse_uint64(const std::string& flag, const std::string& v);
/// A finite number above `lo` (or at it, with `lo_inclusive`) and at most `hi`; no nan, inf, hex.
double parse_double(const std::string& flag, const std::string& v, double lo, bool lo_inclusive,
                    double hi = std::numeric_limits<double>::max());
/// A comma-separated list of names, none empty.
std::vector<std::string> parse_names(const std::string& flag, const std::string& v);

class Flags {
 public:
  /// `program`: its name in messages and help; `about`: what it does, printed under the usage line.
  Flags(std::string program, std::string about);

  const std::string& program() const { return program_; }

  // The table. Each flag's --help line shows its metavar, its help and its default (the value its
  // destination holds when it is added; none for a number outside the flag's range, such as
  // 0 for "unset, the program decides", which the help or the notes then explain). A flag added again under the same
  // name replaces the earlier one in place (a program's own take on a shared flag).

  /// A whole number in [lo, hi] (int, int64_t, ...).
  template <class Int>
  Flags& integer(const std::string& name, Int& out, int64_t lo, int64_t hi, const std::string& help,
                 const std::string& metavar = "N") {
    const bool in_range = static_cast<int64_t>(out) >= lo && static_cast<int64_t>(out) <= hi;
    return add(name, metavar, help, in_range ? std::to_string(out) : "",
               [&out, name, lo, hi](const std::string& v) { out = static_cast<Int>(parse_int(name, v, lo, hi)); });
  }
  /// A flag whose value may be left out: `--activation-checkpointing` alone is `implicit`.
  template <class Int>
  Flags& integer_or(const std::string& name, Int& out, Int implicit, int64_t lo, int64_t hi, const std::string& help,
                    const std::string& metavar = "K") {
    add(name, "[" + metavar + "]", help, "", [&out, name, lo, hi, implicit](const std::string& v) {
      out = v.empty() ? implicit : static_cast<Int>(parse_int(name, v, lo, hi));
    });
    table_[last_].optional_value = true;
    return *this;
  }
  Flags& seed(const std::string& name, uint64_t& out, const std::string& help);
  Flags& number(const std::string& name, double& out, double lo, bool lo_inclusive, double hi, const std::string& help,
                const std::string& metavar = "X");
  Flags& number(const std::string& name, std::optional<double>& out, double lo, bool lo_inclusive, double hi,
                const std::string& help, const std::string& metavar = "X");
  /// Any text (a path, a name checked later); `non_empty`: refuse "".
  Flags& text(const std::string& name, std::string& out, const std::string& help, const std::string& metavar = "TEXT",
              bool non_empty = false);
  /// One of `choices`.
  Flags& choice(const std::string& name, std::string& out, const std::vector<std::string>& choices,
                const std::string& help);
  /// A switch: present, `out` becomes `value`.
  Flags& toggle(const std::string& name, bool& out, const std::string& help, bool value = true);
  template <class Int>
  Flags& integers(const std::string& name, std::vector<Int>& out, int64_t lo, int64_t hi, const std::string& help,
                  bool* given = nullptr) {
    return add(name, "N,N,...", help, list_text(out), [&out, name, lo, hi, given](const std::string& v) {
      const auto n = parse_int_list(name, v, lo, hi);
      out.assign(n.begin(), n.end());
      if (given != nullptr) *given = true;
    });
  }
  Flags& names(const std::string& name, std::vector<std::string>& out, const std::string& help, bool* given = nullptr);
  /// Anything else: `set` gets the value (empty for a switch, `metavar` empty).
  Flags& custom(const std::string& name, const std::string& metavar, const std::string& help,
                std::function<void(const std::string&)> set);
  /// The last flag added is left out of --help (a worker's flag, set by the program itself).
  Flags& hidden();
  /// Arguments that are not flags (a mode, paths): `metavar` in the usage line; none by default.
  Flags& positionals(const std::string& metavar, size_t min, size_t max);
  /// Text printed after the flags in --help (what the flags do together, the exit status).
  Flags& notes(const std::string& text);

  /// Parses argv[first...], setting each flag's destination, and returns the positionals. --help
  /// or -h anywhere prints help() on stdout and exits 0. Throws UsageError for an unknown flag, a
  /// missing or bad value, or too many or too few positionals.
  std::vector<std::string> parse(int argc, char** argv, int first = 1) const;

  /// --help or -h in argv[first...]: prints help() on stdout and exits 0 (parse() does it first).
  void answer_help(int argc, char** argv, int first = 1) const;

  /// The usage line, `about`, one line per flag, the notes.
  std::string help() const;

 private:
  struct Flag {
    std::string name, metavar, help, default_text;
    std::function<void(const std::string&)> set;
    bool optional_value = false;
    bool hidden = false;
  };
  Flags& add(const std::string& name, const std::string& metavar, const std::string& help,
             const std::string& default_text, std::function<void(const std::string&)> set);
  template <class T>
  static std::string list_text(const std::vector<T>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
    return s;
  }
  const Flag* find(const std::string& name) const;

  std::string program_, about_, notes_, positional_metavar_;
  size_t min_positionals_ = 0, max_positionals_ = 0;
  std::vector<Flag> table_;
  size_t last_ = 0;  ///< the flag added last (hidden() marks it)
};

}  // namespace fsdp::programs
