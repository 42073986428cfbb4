#include "programs/program.h"

#include "fsdp/error.h"
#include "programs/flags.h"
#include "programs/json_row.h"

#include <cstdlib>
#include <iostream>
#include <sstream>

namespace fsdp::programs {

std::string message_of(const std::exception_ptr& error) {
  std::istringstream in(fsdp::error_text(error));
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

std::string Program::who() const {
  if (rank_ >= 0) return name_ + " (rank " + std::to_string(rank_) + ")";
  const char* env = std::getenv("RANK");
  if (env != nullptr && *env != '\0') return name_ + " (rank " + env + ")";
  return name_;
}

int Program::main(const std::function<int()>& body) const {
  try {
    return body();
  } catch (const UsageError& e) {
    std::cerr << who() << ": " << e.what() << (e.see_help ? "; see " + name_ + " --help" : "") << "\n";
    return kUsageExit;
  } catch (...) {
    const std::string message = message_of(std::current_exception());
    std::cerr << who() << ": " << message << "\n";
    if (json_errors_) JsonRow().add("error", message).add("rank", rank_).print();
    return kErrorExit;
  }
}

}  // namespace fsdp::programs
