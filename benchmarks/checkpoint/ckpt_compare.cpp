// ckpt_bench compare: every figure side by side in one run on one disk, for each world size: this
// library's save (buffered, and O_DIRECT) and load against the raw disk, its asynchronous save, and
// PyTorch DCP (benchmarks/checkpoint/dcp_bench.py, FSDP2, the same model and AdamW state) saving and loading
// the same state; then a resharding load (largest world size -> one rank fewer) of both. Each run's
// ranks are started by the benchmarks' launcher (bench_launch.h: torchrun's environment, a
// deadline); progress on stderr, one table or JSON line per row on stdout.
#include "benchmarks/bench_launch.h"
#include "benchmarks/checkpoint/ckpt_modes.h"
#include "benchmarks/checkpoint/ckpt_raw_io.h"
#include "checkpoint/commit.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <sstream>

#ifndef FSDP_BENCH_PYTHON
#define FSDP_BENCH_PYTHON ""
#endif
#ifndef FSDP_BENCH_DCP_SCRIPT
#define FSDP_BENCH_DCP_SCRIPT "benchmarks/checkpoint/dcp_bench.py"
#endif

namespace ckpt {
namespace {

using json = nlohmann::json;  // compare's rows: keys in order of name

// The JSON lines `output` holds (a rank's stdout); at least one.
std::vector<json> json_lines(const std::string& output, const std::string& label) {
  std::vector<json> lines;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] == '{') lines.push_back(json::parse(line));
  }
  TORCH_CHECK(!lines.empty(), "ckpt_bench compare: no result from ", label);
  return lines;
}

double median_of(const std::vector<json>& lines, const char* key) {
  std::vector<double> v;
  for (const auto& l : lines) v.push_back(l.at(key).get<double>());
  return median(v);
}

// Prints `rows` as JSON lines or as the table.
void print_rows(const std::vector<json>& rows, bool as_json) {
  for (const auto& r : rows) {
    if (as_json) {
      std::cout << r.dump() << std::endl;
      continue;
    }
    std::cout << (r.contains("saved_world_size") ? "reshard " + std::to_string(r["saved_world_size"].get<int>()) + "->"
                                                 : std::string("ranks "))
              << r["world_size"] << ":";
    for (const auto& [k, v] : r.items()) {
      if (k != "world_size" && k != "saved_world_size") std::cout << "  " << k << "=" << v.dump();
    }
    std::cout << std::endl;
  }
}

}  // namespace

int compare_mode(const Flags& f) {
  const std::string python = FSDP_BENCH_PYTHON;
  TORCH_CHECK(!python.empty() && ::access(python.c_str(), X_OK) == 0, "ckpt_bench compare: no Python with torch at '",
              python, "' (configure with the virtualenv: scripts/build.sh)");
  std::string dir = f.dir;
  if (dir.empty()) {
    char tmpl[] = "/tmp/ckpt-bench-XXXXXX";
    TORCH_CHECK(::mkdtemp(tmpl) != nullptr, "ckpt_bench: mkdtemp failed");
    dir = tmpl;
  }
  ::mkdir(dir.c_str(), 0755);
  const std::vector<std::string> model = {"--n-layer", std::to_string(f.model.n_layer),
                                          "--n-embd",  std::to_string(f.model.n_embd),
                                          "--n-head",  std::to_string(f.model.n_head)};
  const int runs = 6 * static_cast<int>(f.worlds.size()) + (f.worlds.back() > 1 ? 2 : 0);
  int k = 0;
  // One run of `argv` (program and mode arguments) at n ranks: its rank 0's JSON lines.
  auto run = [&](const std::string& label, int n, std::vector<std::string> argv) {
    argv.insert(argv.end(), model.begin(), model.end());
    bench::Launch l;
    l.label = label + " N=" + std::to_string(n);
    l.argv = std::move(argv);
    l.world_size = n;
    l.threads_per_rank = 1;
    l.run_timeout_s = f.run_timeout_s;
    char progress[48];
    std::snprintf(progress, sizeof(progress), "ckpt_bench compare [%2d/%d]", ++k, runs);
    return json_lines(bench::launch_stdout(l, progress).at(0), l.label);
  };
  const std::string self = bench::self_exe();
  auto ours = [&](const std::string& label, int n, std::vector<std::string> args) {
    args.insert(args.begin(), self);
    return run("ours " + label, n, std::move(args));
  };
  auto dcp = [&](const std::string& label, int n, std::vector<std::string> args) {
    args.insert(args.begin(), {python, FSDP_BENCH_DCP_SCRIPT});
    return run("dcp " + label, n, std::move(args))[0];
  };
  const std::string reps = std::to_string(f.reps), threads = std::to_string(f.io_threads);
  std::vector<json> rows;
  for (int n : f.worlds) {
    const std::string d = dir + "/w" + std::to_string(n);
    ::mkdir(d.c_str(), 0755);
    const auto save = ours("save", n, {"save", "--dir", d + "/ours", "--reps", reps, "--io-threads", threads});
    const auto direct =
        ours("save --direct", n, {"save", "--dir", d + "/direct", "--direct", "--reps", reps, "--io-threads", threads});
    const auto load = ours("load", n, {"load", "--dir", d + "/ours", "--reps", reps, "--io-threads", threads});
    const auto async =
        ours("async", n, {"async", "--dir", d + "/async", "--async-reps", std::to_string(f.async_reps)})[0];
    const json dsave =
        dcp("save", n,
            {"save", "--dir", d + "/dcp", "--reps", reps, "--async-reps", std::to_string(std::min(f.async_reps, 5))});
    const json dload = dcp("load", n, {"load", "--dir", d + "/dcp", "--reps", reps});
    json row;
    row["world_size"] = n;
    row["bytes_total"] = save.back().at("bytes_total");
    row["save_s"] = median_of(save, "save_s");
    row["save_over_raw_write"] = median_of(save, "save_over_raw");
    row["save_direct_over_raw_direct_write"] = median_of(direct, "save_over_raw");
    row["save_MBps"] = median_of(save, "save_MBps");
    row["raw_write_MBps"] = median_of(save, "raw_MBps");
    row["load_s"] = median_of(load, "load_s");
    row["load_over_raw_read"] = median_of(load, "load_over_raw");
    row["load_in_place_over_raw_read"] = median_of(load, "load_in_place_over_raw");
    row["read_bytes_over_needed"] = load.back().at("read_over_needed");
    row["async_stall_s"] = async.at("async_stall_s_median");
    row["async_stall_over_sync_save"] = async.at("stall_over_sync_save");
    row["async_stall_over_memcpy"] = async.at("stall_over_memcpy");
    row["step_slowdown_during_async"] =
        async.at("steps_during_async").get<int>() > 0
            ? async.at("step_s_during_async").get<double>() / async.at("step_s_plain").get<double>()
            : 0.0;
    row["host_peak_bytes"] = async.at("host_peak_bytes");
    row["async_saves"] = f.async_reps;
    row["rss_first_last_async"] = {async.at("rss_after_each_async").front(), async.at("rss_after_each_async").back()};
    row["dcp_save_s"] = dsave.at("save_s_median");
    row["save_over_dcp"] = row["save_s"].get<double>() / dsave.at("save_s_median").get<double>();
    row["dcp_load_s"] = dload.at("load_s_median");
    row["load_over_dcp"] = row["load_s"].get<double>() / dload.at("load_s_median").get<double>();
    row["dcp_read_bytes_over_needed"] = dload.at("read_over_needed");
    row["dcp_async_stall_s"] = dsave.at("async_stall_s_median");
    row["async_stall_over_dcp_async_stall"] =
        async.at("async_stall_s_median").get<double>() / dsave.at("async_stall_s_median").get<double>();
    row["dcp_host_peak_bytes"] = dsave.at("host_peak_rss_bytes");
    row["bytes_on_disk"] = bytes_under(fsdp::checkpoint::latest_checkpoint(d + "/ours"));
    row["dcp_bytes_on_disk"] = dsave.at("bytes_on_disk");
    rows.push_back(row);
    if (n == f.worlds.back() && n > 1) {  // the resharding load: n -> n - 1 ranks
      const auto rload = ours("load", n - 1, {"load", "--dir", d + "/ours", "--reps", reps, "--io-threads", threads});
      const json rdload = dcp("load", n - 1, {"load", "--dir", d + "/dcp", "--reps", reps});
      json r;
      r["world_size"] = n - 1;
      r["saved_world_size"] = n;
      r["load_s"] = median_of(rload, "load_s");
      r["load_over_raw_read"] = median_of(rload, "load_over_raw");
      r["load_in_place_over_raw_read"] = median_of(rload, "load_in_place_over_raw");
      r["read_bytes_over_needed"] = rload.back().at("read_over_needed");
      r["dcp_load_s"] = rdload.at("load_s_median");
      r["load_over_dcp"] = r["load_s"].get<double>() / rdload.at("load_s_median").get<double>();
      r["dcp_read_bytes_over_needed"] = rdload.at("read_over_needed");
      r["dcp_verified"] = rdload.at("verified");
      rows.push_back(r);
    }
    if (!fsdp::checkpoint::remove_tree(d)) std::cerr << "ckpt_bench: could not remove " << d << std::endl;
  }
  print_rows(rows, f.json);
  if (f.dir.empty()) ::rmdir(dir.c_str());
  return 0;
}

}  // namespace ckpt
