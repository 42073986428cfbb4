#include "benchmarks/fsdp/bench_report.h"

#include "benchmarks/bench_model.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

namespace bench {
namespace {

std::string mib(double bytes) {
  if (bytes < 0) return "-";
  char b[32];
  std::snprintf(b, sizeof(b), "%.1f", bytes / (1024.0 * 1024.0));
  return b;
}
std::string gib(double bytes) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.2f", bytes / (1024.0 * 1024.0 * 1024.0));
  return b;
}
std::string ratio(double a, double b) {
  if (a < 0 || b <= 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f", a / b);
  return buf;
}
std::string num(double v, const char* f = "%.0f") {
  if (v < 0) return "-";
  char b[48];
  std::snprintf(b, sizeof(b), f, v);
  return b;
}

const char* kColours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf"};

}  // namespace

void print_table(const std::vector<Row>& rows) {
  std::printf("%-13s %-9s %-4s %2s %2s | %9s %9s %9s | %9s %9s %6s | %9s %9s %6s | %9s | %7s %6s\n", "impl", "strategy",
              "prec", "N", "S", "peak MiB", "RSS MiB", "cache MiB", "state@step", "formula", "ratio", "statepeak",
              "formula", "ratio", "step ms", "comm/Ψ", "ratio");
  for (const auto& r : rows) {
    if (r.impl == "simulated") continue;
    const double psi = static_cast<double>(r.params);
    std::printf("%-13s %-9s %-4s %2d %2s | %9s %9s %9s | %10s %9s %6s | %9s %9s %6s | %9s | %7s %6s\n", r.impl.c_str(),
                r.strategy.c_str(), r.precision.c_str(), r.world_size,
                hybrid_row(r.strategy) ? std::to_string(r.shard_group_size).c_str() : "", mib(r.peak_bytes).c_str(),
                mib(r.peak_rss_bytes).c_str(), mib(r.cached_bytes).c_str(), mib(r.state_bytes_at_step).c_str(),
                mib(r.formula_at_step).c_str(), ratio(r.state_bytes_at_step, r.formula_at_step).c_str(),
                mib(r.state_bytes_peak).c_str(), mib(r.formula_peak).c_str(),
                ratio(r.state_bytes_peak, r.formula_peak).c_str(), num(r.step_ms, "%.1f").c_str(),
                r.comm_elements < 0 ? "-" : num(r.comm_elements / psi, "%.4f").c_str(),
                ratio(r.comm_elements, r.comm_formula).c_str());
  }
  std::printf(
      "peak: counting allocator, largest rank; RSS: VmHWM; cache: buffers kept for reuse after the step (not model "
      "state; at most 2 x (prefetch + 2) of the largest unit's); state: parameters + gradients + AdamW state, and "
      "diloco's outer state (at the step; at its peak in the step); comm/Ψ: elements sent per step / Ψ, ratio to 3Ψ "
      "(full; hybrid and diloco, whose H = 1 sends hybrid's, +2Ψ/S) or 2Ψ.\n");
}

void print_fsdp2_ratios(const std::vector<Row>& rows) {
  bool header = false;
  for (const auto& theirs : rows) {
    if (theirs.impl != "pytorch-fsdp2") continue;
    for (const auto& ours : rows) {
      if (ours.impl != "libtorch-fsdp" || ours.strategy != theirs.strategy || ours.world_size != theirs.world_size ||
          ours.precision != theirs.precision) {
        continue;
      }
      if (!header) {
        std::printf(
            "\nlibtorch-fsdp / PyTorch FSDP2, same model, batch, optimizer and backend "
            "(RSS-base: growth of RSS after the process group was set up):\n");
        std::printf("%-9s %-4s %2s | %9s %9s %9s %9s %9s\n", "strategy", "prec", "N", "peak", "RSS", "RSS-base",
                    "state", "step time");
        header = true;
      }
      std::printf(
          "%-9s %-4s %2d | %9s %9s %9s %9s %9s\n", ours.strategy.c_str(), ours.precision.c_str(), ours.world_size,
          ratio(ours.peak_bytes, theirs.peak_bytes).c_str(), ratio(ours.peak_rss_bytes, theirs.peak_rss_bytes).c_str(),
          ratio(ours.peak_rss_bytes - ours.base_rss_bytes, theirs.peak_rss_bytes - theirs.base_rss_bytes).c_str(),
          ratio(ours.state_bytes_at_step, theirs.state_bytes_at_step).c_str(),
          ratio(ours.step_ms, theirs.step_ms).c_str());
    }
  }
}

void print_simulated(const std::vector<Row>& rows) {
  bool header = false;
  auto measured_gib = [](const Row& r, double bytes) { return r.measured && bytes >= 0 ? gib(bytes) : "-"; };
  for (const auto& r : rows) {
    if (r.impl != "simulated") continue;
    if (!header) {
      std::printf(
          "\nsimulated: rank 0 of N over a process group that communicates nothing (full sharding, "
          "construction-time sharding), GiB per rank; on cuda the allocator's peaks include cuBLAS's workspace, "
          "shown apart; sent (= received) per step by ring collectives, from shapes\n");
      std::printf("%-5s %-4s %14s %5s | %10s %10s %6s | %10s %10s %6s | %10s %10s %7s | %9s %9s | %s\n", "model", "dev",
                  "Ψ", "N", "state@step", "16Ψ/N", "ratio", "statepeak", "formula", "ratio", "alloc peak", "build peak",
                  "cuBLAS", "step ms", "sent", "");
      header = true;
    }
    std::printf("%-5s %-4s %14lld %5d | %10s %10s %6s | %10s %10s %6s | %10s %10s %7s | %9s %9s | %s\n",
                r.model.c_str(), r.device.c_str(), static_cast<long long>(r.params), r.world_size,
                measured_gib(r, r.state_bytes_at_step).c_str(), gib(r.formula_at_step).c_str(),
                ratio(r.state_bytes_at_step, r.formula_at_step).c_str(), measured_gib(r, r.state_bytes_peak).c_str(),
                gib(r.formula_peak).c_str(), ratio(r.state_bytes_peak, r.formula_peak).c_str(),
                measured_gib(r, r.peak_bytes).c_str(), measured_gib(r, r.construction_peak_bytes).c_str(),
                measured_gib(r, r.cublas_workspace_bytes).c_str(),
                r.measured && r.device == "cuda" ? num(r.step_ms, "%.1f").c_str() : "-",
                measured_gib(r, r.comm_send_bytes).c_str(), r.note.c_str());
  }
}

std::string to_json(const std::vector<Row>& rows) {
  std::ostringstream o;
  o.precision(15);
  auto str = [](const std::string& s) {
    std::string e = "\"";
    for (char c : s) {
      if (c == '"' || c == '\\') {
        e += '\\';
        e += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char u[8];
        std::snprintf(u, sizeof(u), "\\u%04x", c);
        e += u;
      } else {
        e += c;
      }
    }
    return e + "\"";
  };
  auto val = [](double v) -> std::string {
    if (v < 0 || !std::isfinite(v)) return "null";  // not measured, or a diverged loss
    std::ostringstream s;
    s.precision(15);
    s << v;
    return s.str();
  };
  o << "[\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    o << " {\"impl\": " << str(r.impl) << ", \"strategy\": " << str(r.strategy) << ", \"model\": " << str(r.model)
      << ", \"world_size\": " << r.world_size << ", \"shard_group_size\": " << r.shard_group_size
      << ", \"params\": " << r.params << ", \"measured\": " << (r.measured ? "true" : "false")
      << ", \"note\": " << str(r.note) << ",\n  \"peak_bytes\": " << val(r.peak_bytes)
      << ", \"peak_rss_bytes\": " << val(r.peak_rss_bytes) << ", \"base_rss_bytes\": " << val(r.base_rss_bytes)
      << ", \"construction_peak_bytes\": " << val(r.construction_peak_bytes)
      << ",\n  \"state_bytes_at_step\": " << val(r.state_bytes_at_step)
      << ", \"state_bytes_peak\": " << val(r.state_bytes_peak) << ", \"cached_bytes\": " << val(r.cached_bytes)
      << ", \"cached_cap_bytes\": " << val(r.cached_cap_bytes) << ", \"other_bytes_peak\": " << val(r.other_bytes_peak)
      << ", \"activation_checkpointing\": " << r.activation_checkpointing
      << ", \"formula_at_step\": " << val(r.formula_at_step) << ", \"formula_peak\": " << val(r.formula_peak)
      << ", \"formula_at_step_text\": " << str(formula_text(r.strategy, false))
      << ", \"formula_peak_text\": " << str(formula_text(r.strategy, true, r.precision))
      << ", \"precision\": " << str(r.precision) << ",\n  \"step_ms\": " << val(r.step_ms)
      << ", \"comm_elements\": " << val(r.comm_elements) << ", \"comm_formula\": " << val(r.comm_formula)
      << ", \"comm_expected\": " << val(r.comm_expected) << ", \"loss\": " << val(r.loss)
      << ", \"collective_timeout_s\": " << val(r.collective_timeout_s) << ",\n  \"device\": " << str(r.device)
      << ", \"cublas_workspace_bytes\": " << val(r.cublas_workspace_bytes)
      << ", \"host_construction_peak_bytes\": " << val(r.host_construction_peak_bytes)
      << ", \"comm_send_bytes\": " << val(r.comm_send_bytes) << ", \"comm_recv_bytes\": " << val(r.comm_recv_bytes)
      << "}" << (i + 1 < rows.size() ? ",\n" : "\n");
  }
  o << "]\n";
  return o.str();
}

void write_svg(const std::vector<Row>& rows, const std::string& path) {
  // Three panels, x: world size (log2), y: MiB per rank. Model state at the step and at its peak
  // in the step, measured (circles) against the formulas (dashed); then everything the allocator
  // held at its peak (activations included), with PyTorch's FSDP2 beside full sharding.
  // One precision per plot: the first measured (the JSON has them all).
  std::string plotted;
  for (const auto& r : rows) {
    if (r.impl != "simulated" && plotted.empty()) plotted = r.precision;
  }
  std::vector<std::string> names;
  std::vector<int> worlds;
  double ymax = 0;
  for (const auto& r : rows) {
    if (r.impl == "simulated" || r.precision != plotted) continue;
    if (r.impl == "libtorch-fsdp" && std::find(names.begin(), names.end(), r.strategy) == names.end()) {
      names.push_back(r.strategy);
    }
    if (std::find(worlds.begin(), worlds.end(), r.world_size) == worlds.end()) worlds.push_back(r.world_size);
    ymax = std::max({ymax, r.state_bytes_at_step, r.state_bytes_peak, r.formula_peak, r.formula_at_step, r.peak_bytes});
  }
  TORCH_CHECK(!names.empty(), "fsdp_bench: no libtorch-fsdp rows to plot");
  std::sort(worlds.begin(), worlds.end());
  ymax = ymax / (1024.0 * 1024.0) * 1.05;
  const double W = 440, left = 70, top = 40, pw = 340, ph = 250;
  const int legend_rows = static_cast<int>(names.size()) + 1;
  const double H = top + ph + 50 + 18.0 * legend_rows;
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << 3 * W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  const double lx0 = std::log2(worlds.front()), lx1 = std::max(std::log2(worlds.back()), lx0 + 1);
  const char* titles[] = {"model state per rank at the optimizer step", "model state per rank at its peak in the step",
                          "allocator peak per rank (with activations)"};
  for (int panel = 0; panel < 3; ++panel) {
    const double ox = panel * W + left;
    auto X = [&](double n) { return ox + (std::log2(n) - lx0) / (lx1 - lx0) * pw; };
    auto Y = [&](double bytes) { return top + ph - bytes / (1024.0 * 1024.0) / ymax * ph; };
    s << "<text x=\"" << ox + pw / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">" << titles[panel]
      << "</text>\n<rect x=\"" << ox << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
      << "\" fill=\"none\" stroke=\"#444\"/>\n";
    for (int k = 0; k <= 4; ++k) {
      const double y = top + ph - ph * k / 4;
      s << "<text x=\"" << ox - 6 << "\" y=\"" << y + 4 << "\" text-anchor=\"end\">" << num(ymax * k / 4)
        << "</text>\n<line x1=\"" << ox << "\" x2=\"" << ox + pw << "\" y1=\"" << y << "\" y2=\"" << y
        << "\" stroke=\"#ddd\"/>\n";
    }
    for (int n : worlds) {
      s << "<text x=\"" << X(n) << "\" y=\"" << top + ph + 16 << "\" text-anchor=\"middle\">" << n << "</text>\n";
    }
    s << "<text x=\"" << ox + pw / 2 << "\" y=\"" << top + ph + 34 << "\" text-anchor=\"middle\">ranks N</text>\n"
      << "<text transform=\"rotate(-90)\" x=\"" << -(top + ph / 2) << "\" y=\"" << ox - 50
      << "\" text-anchor=\"middle\">MiB per rank</text>\n";
    for (size_t i = 0; i <= names.size(); ++i) {
      const bool fsdp2 = i == names.size();
      if (fsdp2 && panel < 2) continue;
      const char* colour = fsdp2 ? "#000000" : kColours[i % 6];
      std::string line;
      for (const auto& r : rows) {
        if (r.precision != plotted) continue;
        if (fsdp2 ? r.impl != "pytorch-fsdp2" : (r.impl != "libtorch-fsdp" || r.strategy != names[i])) continue;
        const double f = panel == 0 ? r.formula_at_step : panel == 1 ? r.formula_peak : r.peak_bytes;
        const double m = panel == 0 ? r.state_bytes_at_step : panel == 1 ? r.state_bytes_peak : r.peak_bytes;
        line += (line.empty() ? "M" : " L") + num(X(r.world_size), "%.1f") + "," + num(Y(f), "%.1f");
        if (fsdp2) {
          s << "<rect x=\"" << X(r.world_size) - 4 << "\" y=\"" << Y(m) - 4
            << "\" width=\"8\" height=\"8\" fill=\"none\" stroke=\"#000\" stroke-width=\"2\"/>\n";
        } else {
          s << "<circle cx=\"" << X(r.world_size) << "\" cy=\"" << Y(m) << "\" r=\"" << 5 - static_cast<double>(i) * 0.6
            << "\" fill=\"none\" stroke=\"" << colour << "\" stroke-width=\"2\"/>\n";
        }
      }
      s << "<path d=\"" << line << "\" fill=\"none\" stroke=\"" << colour << "\""
        << (panel < 2 ? " stroke-dasharray=\"5,3\"" : "") << "/>\n";
    }
  }
  for (size_t i = 0; i <= names.size(); ++i) {
    const double y = top + ph + 62 + 18 * static_cast<double>(i);
    const bool fsdp2 = i == names.size();
    s << (fsdp2 ? "<rect x=\"" + num(left - 4) + "\" y=\"" + num(y - 8) +
                      "\" width=\"8\" height=\"8\" fill=\"none\" stroke=\"#000\" stroke-width=\"2\"/>"
                : "<circle cx=\"" + num(left) + "\" cy=\"" + num(y - 4) + "\" r=\"4\" fill=\"none\" stroke=\"" +
                      kColours[i % 6] + "\" stroke-width=\"2\"/>")
      << "<text x=\"" << left + 12 << "\" y=\"" << y << "\">"
      << (fsdp2 ? std::string("PyTorch FSDP2 (fully_shard), right panel only")
                : names[i] + ": formula at the step " + formula_text(names[i], false) + ", at the peak " +
                      formula_text(names[i], true))
      << "</text>\n";
  }
  s << "<text x=\"" << W + left << "\" y=\"" << top + ph + 62
    << "\">circles: measured, largest rank; dashed lines: the formulas (fsdp/strategy.h)</text>\n"
    << "<text x=\"" << W + left << "\" y=\"" << top + ph + 80
    << "\">Ψ parameters, Ψr the root unit's, Ψu the largest unit's; N ranks, S hybrid's group</text>\n</svg>\n";
  std::ofstream f(path);
  f << s.str();
  TORCH_CHECK(f.good(), "fsdp_bench: cannot write the plot to ", path);
}

}  // namespace bench
