// fsdp-trace: read the flight recorder's files of every rank (fsdp/internal/flight_recorder.h)
// and say which rank is behind, at which collective, and what the others wait in.
//
//   fsdp-trace [--json] DIR|FILE...
//
// Exit status: 0 when the files were read (whether or not a rank is behind: the report says),
// 1 when a file cannot be read or a directory holds none, 2 on bad usage.
#include "programs/flags.h"
#include "programs/program.h"
#include "tools/trace_report.h"

#include <iostream>
#include <string>
#include <vector>

namespace {

const char* const kAbout =
    "  Reads the flight recorder's files (fsdp-trace-rank-<rank>.json, written on a collective's timeout or\n"
    "  failure, or on FSDP_DUMP_ON_SIGNAL) of every rank and prints, per group, each rank's last collective,\n"
    "  the rank that is behind and the collective the others wait in. A rank without a file (stopped,\n"
    "  killed) is placed by the heartbeat the other ranks recorded of it.\n"
    "  DIR: every fsdp-trace-*.json in it (FSDP_FLIGHT_RECORDER_DIR, default /tmp/fsdp-trace).\n"
    "  Files of different runs, or two files of one rank, are refused (remove the older ones).\n"
    "  Exit status: 0 when the files were read (a rank behind or not), 1 when a file cannot be read, a\n"
    "  directory holds none, or the files are not of one run; 2 on bad usage.\n";

}  // namespace

int main(int argc, char** argv) {
  fsdp::programs::Program program("fsdp-trace");
  return program.main([&] {
    bool as_json = false;
    fsdp::programs::Flags flags("fsdp-trace", kAbout);
    flags.toggle("--json", as_json, "the report as JSON on stdout").positionals("DIR|FILE...", 1, 1 << 20);
    const std::vector<std::string> paths = flags.parse(argc, argv);
    const auto dumps = fsdp::trace::read_dumps(paths);
    const auto report = fsdp::trace::analyze(dumps);
    std::cout << (as_json ? fsdp::trace::format_json(report) : fsdp::trace::format_text(dumps, report));
    return 0;
  });
}
