// Model FLOPs and utilization, counted one way for every program that prints them (train_gpt,
// train_llama, overhead_bench): PaLM's accounting (Chowdhery et al., appendix B), as torchtitan's.
// Per token of a training step (forward and backward):
//   6 x the parameters that multiply (all of them less the embeddings, which are lookups; the
//       output head counts, tied to the token embedding or not)
//   + 12 x layers x heads x head_dim x T   (attention's scores and their use, T the step's length)
// MFU is those FLOPs at the measured tokens per second over the peak of every rank's device.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace fsdp::programs {

struct TransformerShape {
  int64_t params = 0;         ///< every parameter of the whole model (all ranks' shards together), ties once
  int64_t lookup_params = 0;  ///< of those, the embeddings that are only looked up (not a tied head)
  int64_t layers = 0, heads = 0, head_dim = 0;
};

/// 6 (params - lookup_params) + 12 layers heads head_dim seq_len.
double flops_per_token(const TransformerShape& shape, int64_t seq_len);

/// The dense bf16 peak of a device by its name, in TFLOP/s: H100 and H200 (SXM) 989, H100 PCIe
/// 756, A100 312; 0 when the name is not known (the CPU, another GPU): pass --peak-tflops then.
double peak_tflops_of(const std::string& device_name);

/// "cpu", or the CUDA device's name ("NVIDIA H200").
std::string device_name(const c10::Device& device);

/// flops_per_token x tokens_per_s / (peak_tflops x 1e12 x world_size); NaN without a peak.
double mfu(double flops_per_token, double tokens_per_s, double peak_tflops, int world_size);

/// The peak a program's MFU is against: --peak-tflops when given (> 0), else its device's by name.
double resolve_peak_tflops(double given, const c10::Device& device);

/// One step's figures for a JSON row: the FLOPs per token, the global batch's tokens over the
/// step's time, and the MFU they make against `peak_tflops` on each of `world_size` devices.
struct StepThroughput {
  double flops_per_token = 0, tokens_per_s = 0, mfu = 0;
};
StepThroughput step_throughput(const TransformerShape& shape, int64_t seq_len, int64_t global_tokens, double step_ms,
                               double peak_tflops, int world_size);

}  // namespace fsdp::programs
