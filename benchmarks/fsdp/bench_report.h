// fsdp_bench's results: one row per run (all ranks of one strategy at one world size), printed as
// a table, as JSON, and drawn as an SVG plot of per-rank memory against world size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bench {

struct Row {
  std::string impl;  ///< "libtorch-fsdp", "pytorch-fsdp2" or "simulated"
  std::string strategy;
  std::string model;               ///< "default" or a simulated preset ("7b", "70b")
  std::string precision = "fp32";  ///< "fp32", or mixed precision's param_dtype ("bf16", "fp16")
  int world_size = 1;
  int shard_group_size = 1;
  int64_t params = 0;
  bool measured = true;  ///< false: too large for this machine, formulas only
  std::string note;
  // Largest over ranks (step time: the slowest rank's mean); -1 where not measured.
  double peak_bytes = -1, peak_rss_bytes = -1, base_rss_bytes = -1, construction_peak_bytes = -1;
  double state_bytes_at_step = -1, state_bytes_peak = -1;
  /// Buffers kept for reuse beyond the model state (FSDPModule::buffer_cache_stats, largest after a
  /// step), and their cap.
  double cached_bytes = -1, cached_cap_bytes = -1;
  double formula_at_step = 0, formula_peak = 0;
  double step_ms = -1;
  double comm_elements = -1, comm_formula = 0, comm_expected = -1;
  double loss = 0;
  double collective_timeout_s = -1;  ///< the ranks' collective timeout (fsdp_bench --timeout), largest
  /// --activation-checkpointing K (every K-th block; 0: none), the same for every row of a run.
  int activation_checkpointing = 0;
  /// The step's peak minus the model state's peak and the library's buffers: a lower bound of the
  /// activations and temporaries at the peak (the state may be below its own peak then).
  double other_bytes_peak = -1;
  /// Where the rank ran: "cpu", or "cuda" (fsdp_bench --simulate --device cuda): then the bytes
  /// above are the CUDA caching allocator's, cuBLAS's workspaces among them (cublas_workspace_bytes,
  /// held from the first matrix product on), and host_construction_peak_bytes is the host's peak
  /// while the model was built and moved to the GPU unit by unit.
  std::string device = "cpu";
  double cublas_workspace_bytes = -1, host_construction_peak_bytes = -1;
  /// Per step, from the units' shapes and dtypes, as ring algorithms move them (bench_run.h).
  double comm_send_bytes = -1, comm_recv_bytes = -1;
};

void print_table(const std::vector<Row>& rows);
/// ours/FSDP2 ratios (memory and step time) at each world size both were run at.
void print_fsdp2_ratios(const std::vector<Row>& rows);
void print_simulated(const std::vector<Row>& rows);
std::string to_json(const std::vector<Row>& rows);
/// Per-rank model state (at the step and at its peak) and allocator peak against world size, one
/// colour per strategy, the formulas as lines.
void write_svg(const std::vector<Row>& rows, const std::string& path);

}  // namespace bench
