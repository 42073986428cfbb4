// The one way a program's main() ends on an error (examples, benchmarks, tools): a message without
// C++ backtrace (fsdp::error_text) and an exit status, never an abort.
//
//   int main(int argc, char** argv) {
//     return fsdp::programs::Program("fsdp-trace").main([&] { return run(parse(argc, argv)); });
//   }
//
// A UsageError (programs/flags.h) prints "<who>: <what>; see <name> --help" (a bad input file:
// without the pointer to --help) and exits kUsageExit (2); any other exception prints
// "<who>: <message>" and exits kErrorExit (1), after, with json_errors, a last stdout row
// {"error": message, "rank": R}, so that a reader of the JSON stream sees why it ended and where.
// <who> is the name, with " (rank R)" once the rank is known (or the launcher's RANK is set).
#pragma once

#include <exception>
#include <functional>
#include <string>

namespace fsdp::programs {

class Program {
 public:
  explicit Program(std::string name) : name_(std::move(name)) {}

  const std::string& name() const { return name_; }
  /// The rank in messages, once the process group exists (before: the launcher's RANK).
  void set_rank(int rank) { rank_ = rank; }
  /// With --json: an error also ends stdout with {"error": ..., "rank": R}.
  void set_json_errors(bool on) { json_errors_ = on; }

  /// "train_gpt (rank R)", or the name alone outside a launcher.
  std::string who() const;

  /// Runs `body` and returns its exit status, or the error's (above).
  int main(const std::function<int()>& body) const;

 private:
  std::string name_;
  int rank_ = -1;
  bool json_errors_ = false;
};

/// The text of an exception for a user: fsdp::error_text (the message without LibTorch's
/// backtrace), less the "Exception raised from ..." frames an inner error (c10d's) may carry.
std::string message_of(const std::exception_ptr& error);

}  // namespace fsdp::programs
