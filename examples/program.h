// What the example programs' main() share (train_gpt, train_llama): their name with the rank in
// messages, and the one place where every error ends as a message and an exit status, never as an
// abort with a backtrace:
//
//   cli::Program g_program{"train_llama", kUsage};
//   int main(int argc, char** argv) { return g_program.main([&] { return run(parse(argc, argv)); }); }
//
// A bad flag or input file (cli::InputError) prints the message (and the usage, for a flag) and
// exits with cli::kUsageExit; anything else prints "<name> (rank R): <message>" and exits with
// cli::kErrorExit, after, with --json, a last stdout row {"error": message, "rank": R}, so that a
// reader of the JSON stream sees why it ended and on which rank.
#pragma once

#include "examples/cli.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <functional>
#include <iostream>
#include <string>

namespace cli {

/// A flag error: the message and the usage, exit status kUsageExit.
[[noreturn]] inline void usage_error(const std::string& error) {
  throw InputError(error, true);
}

struct Program {
  const char* name;
  const char* usage;
  int rank = -1;      ///< set once the process group exists; before that, the launcher's RANK
  bool json = false;  ///< --json: an error also ends stdout with {"error": ...}

  /// "train_llama (rank R)", or the name alone outside a launcher.
  std::string who() const {
    if (rank >= 0) return std::string(name) + " (rank " + std::to_string(rank) + ")";
    const char* env = std::getenv("RANK");
    if (env != nullptr && *env != '\0') return std::string(name) + " (rank " + env + ")";
    return name;
  }

  /// Runs `body` (parse and run) and returns its exit status, or the error's.
  int main(const std::function<int()>& body) {
    try {
      return body();
    } catch (const InputError& e) {
      std::cerr << who() << ": " << e.what() << "\n";
      if (e.show_usage) std::cerr << usage;
      return kUsageExit;
    } catch (const c10::Error& e) {
      report(without_backtrace(e.what_without_backtrace()));
    } catch (const std::exception& e) {
      report(without_backtrace(e.what()));
    } catch (...) {
      report("stopped by an unknown exception");
    }
    return kErrorExit;
  }

  void report(const std::string& message) const {
    std::cerr << who() << ": " << message << "\n";
    if (json) std::cout << "{\"error\": " << json_string(message) << ", \"rank\": " << rank << "}" << std::endl;
  }
};

}  // namespace cli
