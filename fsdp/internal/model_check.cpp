#include "fsdp/internal/model_check.h"
#include "fsdp/internal/check.h"

#include <c10/core/GradMode.h>

#include <cstring>
#include <sstream>
#include <vector>

namespace fsdp::detail {
namespace {

std::vector<std::string> split_lines(const char* data, size_t n) {
  std::vector<std::string> lines;
  std::string cur;
  for (size_t i = 0; i < n; ++i) {
    if (data[i] == '\n') {
      lines.push_back(cur);
      cur.clear();
    } else {
      cur += data[i];
    }
  }
  if (!cur.empty()) lines.push_back(cur);
  return lines;
}

struct Line {
  std::string kind, name, details;
};

Line parse(const std::string& s) {
  Line l;
  const size_t a = s.find(' ');
  l.kind = s.substr(0, a);
  if (a == std::string::npos) return l;
  const size_t b = s.find(' ', a + 1);
  l.name = s.substr(a + 1, b == std::string::npos ? std::string::npos : b - a - 1);
  if (b != std::string::npos) l.details = s.substr(b + 1);
  return l;
}

std::string noun(const std::string& kind) {
  return kind == "param" ? "parameter" : kind == "option" ? "option" : kind == "buffer" ? "buffer" : kind;
}

// Names the first difference between rank 0's description and rank q's, or returns "".
std::string first_difference(const std::vector<std::string>& ref, const std::vector<std::string>& other, int q) {
  const size_t n = std::min(ref.size(), other.size());
  std::ostringstream os;
  for (size_t i = 0; i < n; ++i) {
    if (ref[i] == other[i]) continue;
    const Line a = parse(ref[i]), b = parse(other[i]);
    if (a.kind == b.kind && a.name == b.name) {
      os << noun(a.kind) << " '" << a.name << "' is " << a.details << " on rank 0 but " << b.details << " on rank "
         << q;
    } else if (a.kind == b.kind) {
      os << noun(a.kind) << " #" << i << " is '" << a.name << "' on rank 0 but '" << b.name << "' on rank " << q;
    } else {
      os << "rank 0 has " << noun(a.kind) << " '" << a.name << "' where rank " << q << " has " << noun(b.kind) << " '"
         << b.name << "'";
    }
    return os.str();
  }
  if (ref.size() != other.size()) {
    const bool longer0 = ref.size() > n;
    const Line extra = parse(longer0 ? ref[n] : other[n]);
    os << "rank " << (longer0 ? 0 : q) << " has " << noun(extra.kind) << " '" << extra.name << "' that rank "
       << (longer0 ? q : 0) << " does not have";
  }
  return os.str();
}

}  // namespace

std::string describe_options(const FullyShardOptions& o) {
  std::ostringstream os;
  os << "option prefetch " << o.prefetch() << '\n'
     << "option bucket_bytes " << o.bucket_bytes() << '\n'
     << "option shard_group_size " << o.shard_group_size() << '\n'
     << "option sync_module_states " << (o.sync_module_states() ? "true" : "false") << '\n'
     << "option verify_collectives " << (o.verify_collectives() ? "true" : "false") << '\n';
  // The device's type only: every rank has its own GPU (cuda:0 on one, cuda:1 on another). A line
  // whether set or not, so that ranks that differ read "option 'device' is cpu on rank 0 but unset".
  os << "option device " << (o.device() ? c10::DeviceTypeName(o.device()->type(), true) : std::string("unset")) << '\n';
  // Mixed precision is in each parameter's line, with its unit's strategy (wrap.cpp), so that a
  // rank with a policy and one without differ on the same line, which the error then names.
  return os.str();
}

std::string describe_offload(const FullyShardOptions& o) {
  // Offloaded units gather full weights over the CPU backend, others over the device's. A line
  // only when set (the description's bytes are a transient of every wrap, which
  // tests/fsdp/test_construction.cpp counts), last, so that a difference reads "rank 0 has option
  // 'offload_policy' that rank 1 does not have".
  return o.offload_policy() ? "option offload_policy set\n" : "";
}

std::string describe_buffers(torch::nn::Module& root) {
  std::ostringstream os;
  for (const auto& kv : root.named_buffers()) {
    const at::Tensor& b = kv.value();
    if (!b.defined()) continue;
    os << "buffer " << kv.key() << ' ' << b.dtype() << ' ' << b.sizes() << " ("
       << c10::DeviceTypeName(b.device().type(), true) << ")\n";
  }
  return os.str();
}

void check_same_model_on_all_ranks(Comm& verified, const std::string& description, const char* api,
                                   const std::string& unit) {
  Comm comm = verified.unverified();
  // One agreement on the description's fingerprint; only when they differ are the descriptions
  // exchanged, and every rank reaches the same verdict from the same bytes, so none is left waiting.
  comm.agree(
      Call::kModelCheck, Fingerprint().add(description).value(), "the model check of fsdp::fully_shard",
      [&] { return "\n" + description; },
      /*vote=*/0,
      [&](const std::vector<std::string>& descriptions) {
        auto lines_of = [](const std::string& d) {
          const size_t body = d.find('\n');  // after "the model check of fsdp::fully_shard"
          return body == std::string::npos ? std::vector<std::string>{}
                                           : split_lines(d.data() + body + 1, d.size() - body - 1);
        };
        const auto ref = lines_of(descriptions[0]);
        std::string diff;
        for (size_t q = 1; q < descriptions.size() && diff.empty(); ++q) {
          diff = first_difference(ref, lines_of(descriptions[q]), static_cast<int>(q));
        }
        const bool in_scope = std::string(api) == "fsdp::ShardingScope";
        ErrorContext context = comm.error_context("the model check of fsdp::fully_shard").api(api);
        if (!unit.empty()) context.unit(unit);
        FSDP_CHECK_IN(context, false, "the model differs between ranks", unit.empty() ? "" : " in " + unit, ": ", diff,
                      ". Every rank must build the same model (same code, same configuration) ",
                      in_scope ? "inside a ShardingScope opened with the same options on every rank."
                               : "and wrap it with the same options before fully_shard.");
      });
}

void broadcast_buffers(Comm& comm, torch::nn::Module& root) {
  if (comm.world_size() == 1) return;
  at::NoGradGuard no_grad;
  for (const auto& kv : root.named_buffers()) {
    if (kv.value().defined() && kv.value().numel() > 0) {
      comm.broadcast(kv.value(), 0, "broadcast of rank 0's buffer '" + kv.key() + "'");
    }
  }
}

}  // namespace fsdp::detail
