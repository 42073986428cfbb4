// One rank of one fsdp_bench run: build the GPT, wrap it, train a few steps and measure. The same
// code serves a rank of a real job (Gloo, started by fsdp_bench) and the one rank of a simulated
// job (fsdp::make_fake_process_group).
#pragma once

#include "benchmarks/bench_model.h"
#include "examples/run_flags.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <map>
#include <optional>
#include <string>

namespace bench {

/// One run's flags: the ones shared with train_gpt (examples/run_flags.h), with fsdp_bench's
/// defaults (fsdp_bench.cpp: parse). shard_group_size is hybrid's S; timeout_s the collective
/// timeout (unset: the library's default).
struct RunOptions : examples::RunFlags {
  /// The kDiLoCo row (bench_model.h): fsdp::optim::DiLoCo at H = 1 over hybrid's replicas, its
  /// outer state counted in the state bytes (the worker's --diloco).
  bool diloco = false;
  /// Where the rank trains: "cpu", or "cuda" (--simulate's rank on this machine's GPU: each unit
  /// moves there as it is built, FullyShardOptions::device; memory from the CUDA allocator).
  std::string device = "cpu";
  /// examples/optimizer_flag.h's: "adamw" (fsdp::optim::FusedAdamW) or "torch-adamw".
  std::string optimizer = "adamw";
};

/// What one rank measured, by name: written as one "name value" line each, so that the driver
/// reads C++ and Python workers alike.
using Report = std::map<std::string, double>;

/// Trains opts.steps steps on `pg` and measures the steps after the first. The counting CPU
/// allocator must be enabled before the call. Keys: params, peak_bytes (allocator, max over the
/// measured steps), peak_rss_bytes (VmHWM), base_rss_bytes (RSS before the model was built),
/// construction_peak_bytes, state_bytes_at_step, state_bytes_peak, step_ms (mean), comm_elements
/// (per step), comm_expected (the same from the units' padded shapes), comm_send_bytes and
/// comm_recv_bytes (per step, from the same shapes and dtypes, as ring algorithms move them: each
/// all-gather or reduce-scatter of P bytes over S ranks sends and receives (S-1)/S x P, an
/// all-reduce twice that), loss, collective_timeout_s (the timeout the model's collectives have).
/// On CUDA the bytes are the caching allocator's, with cublas_workspace_bytes (held by cuBLAS
/// from the first matrix product on, part of peak_bytes) apart, host_construction_peak_bytes the
/// counting CPU allocator's, and step_ms waits for the GPU.
Report run_rank(const RunOptions& opts, const c10::intrusive_ptr<c10d::ProcessGroup>& pg);

void write_report(const Report& report, const std::string& path);
/// Throws naming the file when it is missing or malformed.
Report read_report(const std::string& path);

/// VmHWM and VmRSS of this process, bytes (-1 where /proc is unavailable).
int64_t peak_rss_bytes();
int64_t rss_bytes();
/// MemAvailable of /proc/meminfo, bytes (-1 where unavailable).
int64_t mem_available_bytes();

}  // namespace bench
