#include "programs/flops.h"

#include <cmath>

namespace fsdp::programs {

double flops_per_token(const TransformerShape& s, int64_t seq_len) {
  return 6.0 * static_cast<double>(s.params - s.lookup_params) +
         12.0 * static_cast<double>(s.layers) * static_cast<double>(s.heads) * static_cast<double>(s.head_dim) *
             static_cast<double>(seq_len);
}

double peak_tflops_of(const std::string& name) {
  // Most specific first: "H100 PCIe" before "H100".
  struct Peak {
    const char* part;
    double tflops;
  };
  static const Peak kPeaks[] = {{"H100 PCIe", 756}, {"H200", 989}, {"H100", 989}, {"A100", 312}};
  for (const auto& p : kPeaks) {
    if (name.find(p.part) != std::string::npos) return p.tflops;
  }
  return 0;
}

double mfu(double flops_per_token, double tokens_per_s, double peak_tflops, int world_size) {
  if (!(peak_tflops > 0) || world_size < 1) return std::nan("");
  return flops_per_token * tokens_per_s / (peak_tflops * 1e12 * static_cast<double>(world_size));
}

double resolve_peak_tflops(double given, const c10::Device& device) {
  return given > 0 ? given : peak_tflops_of(device_name(device));
}

StepThroughput step_throughput(const TransformerShape& shape, int64_t seq_len, int64_t global_tokens, double step_ms,
                               double peak_tflops, int world_size) {
  StepThroughput t;
  t.flops_per_token = flops_per_token(shape, seq_len);
  t.tokens_per_s = step_ms > 0 ? static_cast<double>(global_tokens) / (step_ms / 1000.0) : std::nan("");
  t.mfu = mfu(t.flops_per_token, t.tokens_per_s, peak_tflops, world_size);
  return t;
}

}  // namespace fsdp::programs
