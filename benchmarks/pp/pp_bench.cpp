// The pipeline schedules at scale, simulated: each schedule's step and bubble at p up to 64 ranks and
// m up to 512 microbatches, from its action lists (pp/schedule.h) run by the validator's timeline
// (pp/simulate.h) with the per-action times of one Llama stage measured here (forward, and the
// backward as a whole and split into its input and weight passes, pp/split_backward.h), against
// the formulas: GPipe and 1F1B (p-1)/(m+p-1) of the step, interleaved (p-1)/(v m) of the ideal;
// zero bubble against 1F1B, twice: with the split's measured I and W (which together cost more
// than one backward: two autograd passes, one engine run per weight group) and with the whole
// backward's time shared between them as measured (the schedule's own gain). And the first
// stage's microbatches in flight at its peak (its activation memory: GPipe m, 1F1B p).
//
//   build/benchmarks/pp_bench [--n-layer 2] [--n-embd 128] [--block-size 64] [--rows 4] [--repeats 7] [--json]
//
// One process: the times are one stage's (--n-layer layers of --rows x --block-size tokens); the
// transfers between stages are taken as free (on the slower links between nodes they are not:
// ActionCosts::transfer).
#include "examples/llama/llama.h"
#include "fsdp/fsdp.h"
#include "programs/flags.h"
#include "programs/json_row.h"
#include "programs/program.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {

const char* const kAbout =
    "  Each pipeline schedule's step, bubble and first-stage microbatches in flight at p up to 64 and m up\n"
    "  to 512, simulated from its action lists with the per-action times of one Llama stage measured\n"
    "  here, against the formulas. One process. Exit status: 0 done, 2 bad flags, 1 other errors.\n";

using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct StageTimes {
  double forward = 0, backward = 0, input = 0, weight = 0;  // ms, medians
};

// One middle stage (layers only) of `layers` layers: F, B, and I then W, each the median of `repeats`.
StageTimes measure(const llama::Config& c, int64_t layers, int64_t rows, int repeats,
                   const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  const fsdp::tp::Group g(pg);
  llama::LlamaForCausalLM stage(c, g, g, fsdp::pp::LayerRange{1, 3, 0, layers});
  std::vector<double> f, b, i, w;
  for (int r = 0; r < repeats + 1; ++r) {  // the first: warm-up
    torch::manual_seed(r);
    const auto x = torch::randn({rows, c.block_size, c.n_embd}).requires_grad_(true);
    auto t = clock_type::now();
    auto out = stage->forward(x);
    const double tf = ms_since(t);
    const auto grad = torch::randn_like(out);
    t = clock_type::now();
    out.backward(grad);
    const double tb = ms_since(t);
    stage->zero_grad();
    const auto x2 = x.detach().clone().requires_grad_(true);
    out = stage->forward(x2);
    torch::Tensor grad_in;
    t = clock_type::now();
    auto pass = fsdp::pp::backward_input(out, grad, x2, stage->parameters(), grad_in);
    const double ti = ms_since(t);
    out = torch::Tensor();
    t = clock_type::now();
    pass.run();
    const double tw = ms_since(t);
    stage->zero_grad();
    if (r == 0) continue;
    f.push_back(tf), b.push_back(tb), i.push_back(ti), w.push_back(tw);
  }
  return {median(f), median(b), median(i), median(w)};
}

int run(int argc, char** argv) {
  llama::Config c;
  c.n_embd = 128;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.intermediate = 344;
  c.block_size = 64;
  c.vocab_size = 256;
  int64_t layers = 2, rows = 4;
  int repeats = 7;
  bool json = false;
  fsdp::programs::Flags flags("pp_bench", kAbout);
  flags.integer("--n-layer", layers, 1, 1000, "layers per stage", "L")
      .integer("--n-embd", c.n_embd, 8, 1 << 16, "the embedding width (4 heads)", "C")
      .integer("--block-size", c.block_size, 1, 1 << 16, "tokens per row", "T")
      .integer("--rows", rows, 1, 1 << 16, "rows per microbatch", "B")
      .integer("--repeats", repeats, 1, 1000, "measurements of each pass (the median is used)")
      .toggle("--json", json, "one JSON row per schedule, p and m");
  flags.parse(argc, argv);
  c.n_layer = layers;
  c.intermediate = 8 * c.n_embd / 3;
  const std::string shape = llama::shape_error(c, 1);
  if (!shape.empty()) fsdp::programs::usage_error(shape);
  auto pg = fsdp::init_process_group();
  const StageTimes t = measure(c, layers, rows, repeats, pg);
  std::printf(
      "# one stage of %lld layers, %lld x %lld tokens, C %lld: forward %.3f ms, backward %.3f ms = input %.3f + "
      "weight %.3f ms split (I + W over B: %.3f)\n",
      static_cast<long long>(layers), static_cast<long long>(rows), static_cast<long long>(c.block_size),
      static_cast<long long>(c.n_embd), t.forward, t.backward, t.input, t.weight, (t.input + t.weight) / t.backward);
  std::printf("# zero-bubble: the split's measured I and W; zero-bubble@B: I + W at the whole backward's time\n");
  std::printf("# %-13s %4s %4s %12s %12s %9s %9s %8s %8s %s\n", "schedule", "p", "m", "step_ms", "ideal_ms", "bubble",
              "formula", "inflight", "formula", "vs_1f1b");
  using fsdp::pp::ScheduleKind;
  const auto start = clock_type::now();
  for (const int64_t p : {4, 8, 16, 32, 64}) {
    std::vector<int64_t> ms;
    for (int64_t m = p; m <= 512; m *= 2) ms.push_back(m);
    if (ms.back() != 512 && 512 % p == 0) ms.push_back(512);
    for (const int64_t m : ms) {
      double one_f_one_b = 0;
      for (int row = 0; row < 5; ++row) {
        const ScheduleKind kind = row == 0   ? ScheduleKind::k1F1B
                                  : row == 1 ? ScheduleKind::kGPipe
                                  : row == 2 ? ScheduleKind::kInterleaved1F1B
                                             : ScheduleKind::kZeroBubble;
        const bool measured_split = row == 3;  // row 4: zero bubble with the split at the backward's cost
        const int64_t v = kind == ScheduleKind::kInterleaved1F1B ? 2 : 1;
        const fsdp::pp::StageLayout layout(p, v);
        const auto lists = fsdp::pp::make_schedule(kind, layout, m);
        // A rank's layers are split over its v stages: each action costs 1/v of the stage's.
        fsdp::pp::ActionCosts costs;
        costs.forward = t.forward / static_cast<double>(v);
        // B is I + W in the simulator: the measured whole backward, in the measured split's shares.
        const double share = t.input / (t.input + t.weight);
        costs.backward_input = (measured_split ? t.input : t.backward * share) / static_cast<double>(v);
        costs.backward_weight = (measured_split ? t.weight : t.backward * (1 - share)) / static_cast<double>(v);
        const auto tl = fsdp::pp::simulate(lists, layout, m, costs);
        const double ideal = static_cast<double>(m) * (costs.forward + costs.backward_input + costs.backward_weight) *
                             static_cast<double>(v);
        double formula = -1;    // the formula's bubble, where there is one
        int64_t inflight = -1;  // the formula's, where there is one
        if (kind == ScheduleKind::kGPipe || kind == ScheduleKind::k1F1B) {
          formula = static_cast<double>(p - 1) / static_cast<double>(m + p - 1);
          inflight = kind == ScheduleKind::kGPipe ? m : p;
        } else if (kind == ScheduleKind::kInterleaved1F1B) {
          const double x = static_cast<double>(p - 1) / static_cast<double>(v * m);  // of the ideal
          formula = x / (1 + x);
        }
        if (kind == ScheduleKind::k1F1B) one_f_one_b = tl.step;
        const std::string name = fsdp::pp::to_string(kind) + (row == 4 ? "@B" : "");
        if (json) {
          fsdp::programs::JsonRow row;
          row.add("schedule", name)
              .add("p", p)
              .add("m", m)
              .add("stages_per_rank", v)
              .add("step_ms", tl.step, "%.4f")
              .add("ideal_ms", ideal, "%.4f")
              .add("bubble", tl.bubble, "%.6f")
              .add("first_stage_in_flight", tl.peak_in_flight[0])
              .add("step_over_1f1b", tl.step / one_f_one_b, "%.4f");
          if (formula >= 0) row.add("bubble_formula", formula, "%.6f");
          if (inflight >= 0) row.add("in_flight_formula", inflight);
          row.print();
        } else {
          char f[32] = "-";
          if (formula >= 0) std::snprintf(f, sizeof f, "%.5f", formula);
          std::printf("  %-13s %4lld %4lld %12.3f %12.3f %9.5f %9s %8lld %8s %.4f\n", name.c_str(),
                      static_cast<long long>(p), static_cast<long long>(m), tl.step, ideal, tl.bubble, f,
                      static_cast<long long>(tl.peak_in_flight[0]),
                      inflight < 0 ? "-" : std::to_string(inflight).c_str(), tl.step / one_f_one_b);
        }
      }
    }
  }
  std::printf("# simulated in %.1f s\n", ms_since(start) / 1000);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::programs::Program("pp_bench").main([&] { return run(argc, argv); });
}
