#include "benchmarks/bench_launch.h"

namespace bench {

std::vector<Report> launch(const Launch& l, const std::string& progress) {
  Launch run = l;
  run.split_stdout = false;
  const fsdp::programs::RankFiles files = fsdp::programs::launch_ranks(run, progress);
  std::vector<Report> reports;
  reports.reserve(files.outs.size());
  for (const auto& o : files.outs) reports.push_back(read_report(o));
  files.remove();
  return reports;
}

std::vector<std::string> launch_stdout(const Launch& l, const std::string& progress) {
  Launch run = l;
  run.split_stdout = true;
  const fsdp::programs::RankFiles files = fsdp::programs::launch_ranks(run, progress);
  std::vector<std::string> outputs;
  for (const auto& path : files.stdouts) outputs.push_back(fsdp::programs::file_text(path));
  files.remove();
  return outputs;
}

}  // namespace bench
