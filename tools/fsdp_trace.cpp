// fsdp-trace: read the flight recorder's files of every rank (fsdp/internal/flight_recorder.h)
// and say which rank is behind, at which collective, and what the others wait in.
//
//   fsdp-trace [--json] DIR|FILE...
//
// Exit status: 0 when the files were read (whether or not a rank is behind: the report says),
// 1 when a file cannot be read or a directory holds none, 2 on bad usage.
#include "tools/trace_report.h"

#include <cstdio>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  const char* const usage =
      "usage: fsdp-trace [--json] DIR|FILE...\n"
      "  Reads the flight recorder's files (fsdp-trace-rank-<rank>.json, written on a collective's timeout or\n"
      "  failure, or on FSDP_DUMP_ON_SIGNAL) of every rank and prints, per group, each rank's last collective,\n"
      "  the rank that is behind and the collective the others wait in. A rank without a file (stopped,\n"
      "  killed) is placed by the heartbeat the other ranks recorded of it.\n"
      "  DIR: every fsdp-trace-*.json in it (FSDP_FLIGHT_RECORDER_DIR, default /tmp/fsdp-trace).\n"
      "  --json: the report as JSON on stdout.\n"
      "  Files of different runs, or two files of one rank, are refused (remove the older ones).\n"
      "  Exit status: 0 when the files were read (a rank behind or not), 1 when a file cannot be read, a\n"
      "  directory holds none, or the files are not of one run; 2 on bad usage.\n";
  bool as_json = false;
  std::vector<std::string> paths;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::cout << usage;
      return 0;
    }
    if (a == "--json") {
      as_json = true;
    } else if (a.rfind("-", 0) == 0) {
      std::cerr << "fsdp-trace: unknown option '" << a << "'\n" << usage;
      return 2;
    } else {
      paths.push_back(a);
    }
  }
  if (paths.empty()) {
    std::cerr << usage;
    return 2;
  }
  try {
    const auto dumps = fsdp::trace::read_dumps(paths);
    const auto report = fsdp::trace::analyze(dumps);
    std::cout << (as_json ? fsdp::trace::format_json(report) : fsdp::trace::format_text(dumps, report));
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-trace: " << e.what() << "\n";
    return 1;
  }
}
