#include "programs/profile.h"
#include "programs/flags.h"
#include "programs/json_row.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string_view>
#include <utility>

namespace fsdp::programs {
namespace {

namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

constexpr const char* kStepPrefix = "fsdp.step ";
constexpr std::string_view kWaitPrefix = "fsdp.wait.";  // Comm::wait's spans

std::unique_ptr<at::RecordFunction> open_span(const std::string& name) {
  auto span = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (span->isActive()) span->before(name);
  return span;
}

ProfilerConfig config() {
  return ProfilerConfig(ProfilerState::KINETO, /*report_input_shapes=*/false, /*profile_memory=*/false,
                        /*with_stack=*/false);
}

std::set<ActivityType> activities(bool cuda) {
  std::set<ActivityType> a{ActivityType::CPU};
  if (cuda) a.insert(ActivityType::CUDA);
  return a;
}

/// The length of the union of [start, end) intervals, clipped to [lo, hi).
double union_ns(std::vector<std::pair<uint64_t, uint64_t>> v, uint64_t lo, uint64_t hi) {
  std::sort(v.begin(), v.end());
  double total = 0;
  uint64_t cur_s = 0, cur_e = 0;
  bool open = false;
  for (auto [s, e] : v) {
    s = std::max(s, lo);
    e = std::min(e, hi);
    if (e <= s) continue;
    if (open && s <= cur_e) {
      cur_e = std::max(cur_e, e);
      continue;
    }
    if (open) total += static_cast<double>(cur_e - cur_s);
    cur_s = s;
    cur_e = e;
    open = true;
  }
  if (open) total += static_cast<double>(cur_e - cur_s);
  return total;
}

std::vector<ProfiledStep> rows_of(const std::vector<prof::KinetoEvent>& events, const std::vector<std::string>& labels,
                                  bool cuda) {
  const char* const kPhases[] = {"fsdp.forward", "fsdp.backward", "fsdp.optimizer"};
  std::vector<ProfiledStep> rows;
  for (const auto& label : labels) {
    const std::string name = kStepPrefix + label;
    const auto span = std::find_if(events.begin(), events.end(), [&](const prof::KinetoEvent& e) {
      return e.deviceType() == c10::kCPU && e.name() == name;
    });
    if (span == events.end()) continue;
    const uint64_t lo = span->startNs(), hi = span->endNs();
    ProfiledStep row;
    row.label = label;
    row.step_ms = static_cast<double>(hi - lo) / 1e6;
    double cpu[3] = {0, 0, 0};
    struct Span {
      uint64_t start, end;
      int phase;
    };
    std::vector<Span> phase_spans;                    // the program's phases, on the CPU
    std::map<uint64_t, uint64_t> launched_at;         // a CUDA runtime call's correlation id -> its CPU time
    std::vector<const prof::KinetoEvent*> on_device;  // kernels, copies, memsets
    for (const auto& e : events) {
      if (e.startNs() < lo || e.startNs() >= hi) continue;
      const std::string n = e.name();
      const double ms = static_cast<double>(e.durationNs()) / 1e6;
      if (e.deviceType() == c10::kCUDA) {
        if (n.rfind("fsdp.", 0) != 0) on_device.push_back(&e);  // not a GPU copy of an annotation
        continue;
      }
      for (int k = 0; k < 3; ++k) {
        if (n != kPhases[k]) continue;
        cpu[k] += ms;
        phase_spans.push_back({e.startNs(), e.endNs(), k});
      }
      if (n.rfind("cu", 0) == 0 && e.correlationId() != 0) launched_at[e.correlationId()] = e.startNs();
      if (n.rfind(kWaitPrefix, 0) == 0) {
        const std::string op = n.substr(kWaitPrefix.size());
        (op == "all-gather"       ? row.wait_all_gather_ms
         : op == "reduce-scatter" ? row.wait_reduce_scatter_ms
         : op == "all-reduce"     ? row.wait_all_reduce_ms
                                  : row.wait_other_ms) += ms;  // other: agreements, broadcasts, gathers
      }
    }
    row.forward_ms = cpu[0];
    row.backward_ms = cpu[1];
    row.optimizer_ms = cpu[2];
    if (cuda) {
      // On a GPU a phase is the device time of what it launched: each kernel tied to its launch
      // (the CUDA runtime call with its correlation id) and the launch to the phase whose CPU span
      // holds it, whichever thread launched it (backward's: the autograd engine's device thread,
      // inside the main thread's backward span).
      std::vector<std::pair<uint64_t, uint64_t>> busy, by_phase[3];
      size_t tied = 0;
      for (const auto* e : on_device) {
        busy.emplace_back(e->startNs(), e->endNs());
        auto at = launched_at.find(e->correlationId());
        if (at == launched_at.end()) at = launched_at.find(e->linkedCorrelationId());
        if (at == launched_at.end()) continue;
        for (const auto& p : phase_spans) {
          if (at->second < p.start || at->second >= p.end) continue;
          by_phase[p.phase].emplace_back(e->startNs(), e->endNs());
          ++tied;
          break;
        }
      }
      row.gpu_busy_ms = union_ns(busy, lo, hi) / 1e6;
      row.gpu_idle_ms = row.step_ms - row.gpu_busy_ms;
      if (tied > 0) {  // else (no launch found) the phases stay the CPU's spans
        row.forward_ms = union_ns(by_phase[0], lo, hi) / 1e6;
        row.backward_ms = union_ns(by_phase[1], lo, hi) / 1e6;
        row.optimizer_ms = union_ns(by_phase[2], lo, hi) / 1e6;
        row.phases_on_device = true;
      }
    }
    rows.push_back(row);
  }
  return rows;
}

}  // namespace

bool profiled_step(int64_t i, int64_t n) {
  if (n < 5) return i >= 0 && i < n;
  return i >= 2 && i < 5;
}

Phase::Phase(const char* name) : span_(open_span(name)) {}
Phase::~Phase() = default;

StepProfiler::StepProfiler(const std::string& dir) : dir_(dir) {
  if (dir_.empty()) return;
  std::error_code ec;
  if (std::filesystem::exists(dir_, ec) && !std::filesystem::is_directory(dir_, ec)) {
    usage_error("--profile '" + dir_ + "': it exists and is not a directory; give a directory");
  }
  std::filesystem::create_directories(dir_, ec);
  if (ec)
    usage_error("--profile '" + dir_ + "': cannot create that directory (" + ec.message() +
                "); give a writable directory");
  const std::string probe = dir_ + "/.write-test-" + std::to_string(::getpid());
  if (!std::ofstream(probe)) usage_error("--profile '" + dir_ + "': cannot write there; give a writable directory");
  std::filesystem::remove(probe, ec);
}

StepProfiler::~StepProfiler() {
  if (!running_) return;
  step_span_.reset();
  try {
    prof::disableProfiler();  // an error ended training mid-profile: nothing written
  } catch (...) {
  }
}

void StepProfiler::begin(bool profiled, const std::string& label, const c10::Device& device) {
  if (!on() || !profiled || done_) return;  // one profile a run
  if (!running_) {
    cuda_ = device.is_cuda();
    // On the CPU, Kineto logs an error for the GPU it probes for and does not find: quiet it
    // (unless the user set its level).
    if (!cuda_) ::setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
    prof::prepareProfiler(config(), activities(cuda_));
    prof::enableProfiler(config(), activities(cuda_));
    running_ = true;
  }
  labels_.push_back(label);
  step_span_ = open_span(kStepPrefix + label);
}

void StepProfiler::end(bool stop_now, int rank, std::ostream& out) {
  step_span_.reset();
  if (running_ && stop_now) stop(rank, out);
}

void StepProfiler::stop(int rank, std::ostream& out) {
  running_ = false;
  done_ = true;
  std::unique_ptr<prof::ProfilerResult> result = prof::disableProfiler();
  const std::string trace = dir_ + (rank == 0 ? "/trace.json" : "/trace-rank-" + std::to_string(rank) + ".json");
  result->save(trace);
  rows_ = rows_of(result->events(), labels_, cuda_);
  if (rank != 0) return;
  std::ofstream json(dir_ + "/steps.json");
  for (const auto& r : rows_) {
    JsonRow row;
    row.add("step", r.label)
        .add("step_ms", r.step_ms, "%.4f")
        .add("forward_ms", r.forward_ms, "%.4f")
        .add("backward_ms", r.backward_ms, "%.4f")
        .add("optimizer_ms", r.optimizer_ms, "%.4f")
        .add("wait_all_gather_ms", r.wait_all_gather_ms, "%.4f")
        .add("wait_reduce_scatter_ms", r.wait_reduce_scatter_ms, "%.4f")
        .add("wait_all_reduce_ms", r.wait_all_reduce_ms, "%.4f")
        .add("wait_other_ms", r.wait_other_ms, "%.4f")
        .add("gpu_busy_ms", r.gpu_busy_ms >= 0 ? r.gpu_busy_ms : std::nan(""), "%.4f")  // null on the CPU
        .add("gpu_idle_ms", r.gpu_idle_ms >= 0 ? r.gpu_idle_ms : std::nan(""), "%.4f")
        .add("phases", r.phases_on_device ? "device time of their kernels" : "CPU spans");
    json << row.text() << "\n";
  }
  out << "profile: " << rows_.size() << " step(s) in " << trace << " (open it in https://ui.perfetto.dev or "
      << "chrome://tracing), their rows in " << dir_ << "/steps.json\n";
  print_profile_table(rows_, out);
}

void print_profile_table(const std::vector<ProfiledStep>& rows, std::ostream& out) {
  int width = 12;  // the labels' column, as wide as the longest
  for (const auto& r : rows) width = std::max(width, static_cast<int>(r.label.size()));
  char line[512];
  std::snprintf(line, sizeof(line), "%-*s %9s %9s %9s %9s %9s %9s %9s %10s %9s %9s\n", width, "ms", "step", "forward",
                "backward", "optimizer", "wait AG", "wait RS", "wait AR", "wait other", "GPU busy", "GPU idle");
  out << line;
  for (const auto& r : rows) {
    char busy[16] = "-", idle[16] = "-";
    if (r.gpu_busy_ms >= 0) {
      std::snprintf(busy, sizeof(busy), "%.2f", r.gpu_busy_ms);
      std::snprintf(idle, sizeof(idle), "%.2f", r.gpu_idle_ms);
    }
    std::snprintf(line, sizeof(line), "%-*s %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %10.2f %9s %9s\n", width,
                  r.label.c_str(), r.step_ms, r.forward_ms, r.backward_ms, r.optimizer_ms, r.wait_all_gather_ms,
                  r.wait_reduce_scatter_ms, r.wait_all_reduce_ms, r.wait_other_ms, busy, idle);
    out << line;
  }
  out.flush();
}

}  // namespace fsdp::programs
