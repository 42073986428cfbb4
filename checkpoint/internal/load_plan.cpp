#include "checkpoint/internal/load_plan.h"

#include "checkpoint/commit.h"
#include "checkpoint/internal/optimizer_state.h"
#include "checkpoint/internal/rng_state.h"
#include "checkpoint/plan.h"
#include "checkpoint/safetensors.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <sstream>

namespace fsdp::checkpoint::detail {
namespace {

std::string describe(const std::string& dtype, const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << dtype << " " << c10::IntArrayRef(shape);
  return os.str();
}

int64_t file_bytes(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : 0;
}

}  // namespace

Wanted wanted_of(const ShardSpec& s, const std::string& key, const std::string& kind, const at::Tensor& dst) {
  const TensorPlace place = place_of(s);
  return {key, kind,       s.dtype, place.shape, place.row_offset + s.row_begin, place.row_offset + s.row_end,
          dst, place.inner};
}

std::vector<ReadTarget> match(const Manifest& m, const std::vector<Wanted>& wanted, bool strict,
                              const std::string& hint, const std::string& prefix) {
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < m.tensors.size(); ++i) index[m.tensors[i].key] = i;
  std::vector<std::string> missing, different, unexpected;
  std::set<std::string> seen;
  std::vector<ReadTarget> targets;
  for (const Wanted& w : wanted) {
    seen.insert(w.key);
    const auto it = index.find(w.key);
    if (it == index.end()) {
      missing.push_back(w.key + " (" + w.kind + ", " + describe(safetensors_dtype(w.dtype), w.shape) + ")");
      continue;
    }
    const ManifestTensor& t = m.tensors[it->second];
    if (t.dtype != safetensors_dtype(w.dtype) || t.shape != w.shape || t.kind != w.kind) {
      different.push_back(w.key + ": " + t.kind + " " + describe(t.dtype, t.shape) + " in the checkpoint, " + w.kind +
                          " " + describe(safetensors_dtype(w.dtype), w.shape) + " in the model");
      continue;
    }
    if (w.row_end > w.row_begin) targets.push_back({it->second, w.row_begin, w.row_end, w.dst, w.inner});
  }
  for (const auto& t : m.tensors) {
    if (t.key.rfind(prefix, 0) == 0 && seen.count(t.key) == 0) unexpected.push_back(t.key);
  }
  if (!strict) unexpected.clear();
  if (missing.empty() && different.empty() && unexpected.empty()) return targets;
  std::ostringstream os;
  os << "checkpoint '" << m.dir << "' (saved by " << m.world_size
     << " ranks) does not fit the model; nothing was loaded.";
  auto list = [&](const char* what, const std::vector<std::string>& items) {
    if (items.empty()) return;
    os << " " << what << " (" << items.size() << "):";
    for (size_t i = 0; i < items.size() && i < 10; ++i) os << (i ? ";" : "") << " " << items[i];
    if (items.size() > 10) os << "; ...";
    os << ".";
  };
  list("In the model, not in the checkpoint", missing);
  list("Different", different);
  list("In the checkpoint, not in the model", unexpected);
  os << " Load it into the model it was saved from (same architecture, names and dtypes)"
     << (unexpected.empty() || !missing.empty() || !different.empty() ? "" : ", or pass LoadOptions().strict(false)")
     << "; 'fsdp-ckpt inspect " << m.dir << "' lists what it holds." << hint;
  FSDP_CHECK(false, os.str());
}

LoadResult result_of(const Manifest& m, const ReadStats& s) {
  LoadResult r;
  r.path = m.dir;
  r.name = m.name;
  r.step = m.step;
  r.saved_world_size = m.world_size;
  r.metadata = m.metadata;
  r.sampler_state = m.data;
  r.bytes_needed = r.bytes_needed_total = static_cast<int64_t>(s.bytes_needed);
  r.bytes_read = r.bytes_read_total = static_cast<int64_t>(s.bytes_read);
  r.manifest_bytes = file_bytes(m.dir + "/" + kManifest);
  r.preads = static_cast<int64_t>(s.preads);
  r.files_opened = static_cast<int64_t>(s.files);
  return r;
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

OptimizerPlan plan_optimizer(const Manifest& m, const std::vector<ShardSpec>& specs, const torch::optim::Optimizer& opt,
                             std::vector<Wanted>& wanted, const std::string& prefix, const std::string& kind,
                             const std::set<std::string>* within) {
  OptimizerPlan plan;
  plan.type = optimizer_type(opt, "fsdp::checkpoint::load");
  FSDP_CHECK(m.has_optimizer, "checkpoint '", m.dir,
             "' was saved without an optimizer: load the model alone (fsdp::checkpoint::load(path, model)).");
  FSDP_CHECK(m.optimizer.type == plan.type, "checkpoint '", m.dir, "' holds ", m.optimizer.type,
             " state, but the optimizer is ", plan.type, ": load it into the optimizer type it was saved from.");
  std::map<const void*, const ShardSpec*> by_param;
  for (const auto& s : specs) by_param[s.local.unsafeGetTensorImpl()] = &s;
  const auto& groups = opt.param_groups();
  FSDP_CHECK(groups.size() == m.optimizer.param_groups.size(), "checkpoint '", m.dir, "' has ",
             m.optimizer.param_groups.size(), " param group(s) but the optimizer has ", groups.size(),
             ": build the optimizer with the param groups it was saved with.");
  // Saved state names per parameter, from the tensor keys "optim/<name>/<state>".
  std::map<std::string, std::vector<std::string>> saved;
  for (const auto& t : m.tensors) {
    if (t.kind != kind || t.key.rfind(prefix, 0) != 0) continue;
    const size_t slash = t.key.find_last_of('/');
    saved[t.key.substr(prefix.size(), slash - prefix.size())].push_back(t.key.substr(slash + 1));
  }
  const auto allowed = state_names(plan.type);
  std::set<std::string> in_groups;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<std::string> names;
    for (const auto& param : groups[g].params()) {
      const auto it = by_param.find(param.unsafeGetTensorImpl());
      FSDP_CHECK(it != by_param.end(), "the optimizer holds a parameter of shape ", param.sizes(),
                 " that is not one of the wrapped model's: build the optimizer on the wrapped model's parameters "
                 "(model->parameters() after fsdp::fully_shard).");
      const ShardSpec& s = *it->second;
      names.push_back(s.name);
      in_groups.insert(s.name);
      OptimizerPlan::Param p;
      p.param = param;
      for (const auto& n : saved[s.name]) {
        FSDP_CHECK(std::find(allowed.begin(), allowed.end(), n) != allowed.end(), "checkpoint '", m.dir,
                   "' holds optimizer state '", n, "' of parameter '", s.name, "', which ", plan.type,
                   " does not keep: the manifest was edited or written by another program.");
        p.names.push_back(n);
      }
      p.dst = state_destinations(opt, plan.type, param, p.names);
      for (size_t k = 0; k < p.names.size(); ++k) {
        wanted.push_back(wanted_of(s, prefix + s.name + "/" + p.names[k], kind, p.dst[k]));
      }
      const auto step = m.optimizer.steps.find(s.name);
      if (step != m.optimizer.steps.end()) p.step = step->second;
      FSDP_CHECK(plan.type == "SGD" || p.names.empty() || p.step >= 0, "checkpoint '", m.dir, "' holds ", plan.type,
                 " state of parameter '", s.name,
                 "' but no step for it: the manifest was edited or written by another program.");
      plan.params.push_back(std::move(p));
    }
    // A stage's part of each saved group: the saved names, less what other stages hold. Compared as
    // sets: the state goes by name, and a group's order follows how the model registers its
    // parameters, which a pipeline's split changes (a module's own before its children's).
    std::vector<std::string> want;
    for (const auto& n : m.optimizer.param_groups[g].params) {
      if (within == nullptr || within->count(n) == 1) want.push_back(n);
    }
    const std::set<std::string> have(names.begin(), names.end()), saved_set(want.begin(), want.end());
    if (have != saved_set || names.size() != want.size()) {
      std::string missing, extra;
      for (const auto& n : want) {
        if (have.count(n) == 0) missing += (missing.empty() ? "" : ", ") + n;
      }
      for (const auto& n : names) {
        if (saved_set.count(n) == 0) extra += (extra.empty() ? "" : ", ") + n;
      }
      FSDP_CHECK(false, "param group ", g, " of the optimizer does not hold the parameters it was saved with (",
                 names.size(), " now, ", want.size(), " saved",
                 missing.empty() ? std::string() : "; saved, not in the group: " + missing,
                 extra.empty() ? std::string() : "; in the group, not saved: " + extra,
                 missing.empty() && extra.empty() ? "; a parameter listed twice" : "",
                 "): build the optimizer with the param groups it was saved with.");
    }
  }
  for (const auto& kv : saved) {
    if (within != nullptr && within->count(kv.first) == 0) continue;  // another stage's
    FSDP_CHECK(in_groups.count(kv.first) == 1, "checkpoint '", m.dir, "' holds optimizer state of '", kv.first,
               "', which is in none of the optimizer's param groups.");
  }
  return plan;
}

OptimizerPlan plan_outer(const Manifest& m, const std::vector<ShardSpec>& specs, const ReplicaLoad& r,
                         std::vector<Wanted>& wanted) {
  OptimizerPlan plan;
  plan.type = r.outer_type;
  std::map<std::string, std::vector<std::string>> saved;
  for (const auto& t : m.tensors) {
    if (t.kind != "outer") continue;
    const size_t slash = t.key.find_last_of('/');
    saved[t.key.substr(6, slash - 6)].push_back(t.key.substr(slash + 1));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    OptimizerPlan::Param p;
    p.param = r.global[i];
    p.names = saved[specs[i].name];
    p.dst = state_destinations(*r.outer, plan.type, p.param, p.names);
    for (size_t k = 0; k < p.names.size(); ++k) {
      wanted.push_back(wanted_of(specs[i], "outer/" + specs[i].name + "/" + p.names[k], "outer", p.dst[k]));
    }
    const auto step = r.outer_steps.find(specs[i].name);
    if (step != r.outer_steps.end()) p.step = step->second;
    plan.params.push_back(std::move(p));
  }
  return plan;
}

void install(const Manifest& m, torch::optim::Optimizer& opt, const OptimizerPlan& plan) {
  for (const auto& p : plan.params) install_state(opt, plan.type, p.param, p.names, p.dst, p.step);
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    set_group_options(opt.param_groups()[g], plan.type, m.optimizer.param_groups[g].options, "fsdp::checkpoint::load");
  }
}

RngPlan plan_rng(const Manifest& m, int rank, std::vector<Wanted>& wanted) {
  RngPlan plan;
  const std::string mine = rng_prefix(rank), first = rng_prefix(0) + "cpu";
  for (const auto& t : m.tensors) {
    if (t.kind != "rng") continue;
    plan.saved = true;
    if (t.key == first && !t.chunks.empty() && !t.chunks[0].crc32c.empty()) plan.base = t.chunks[0].crc32c[0];
    if (t.key.rfind(mine, 0) != 0) continue;
    const at::ScalarType type = scalar_type_of(t.dtype, t.key);
    at::Tensor dst = at::empty(t.shape, at::TensorOptions().dtype(type));
    wanted.push_back({t.key, "rng", type, t.shape, 0, t.rows(), dst});
    plan.states.emplace_back(t.key.substr(mine.size()), dst);
  }
  return plan;
}

std::string apply_rng(const RngPlan& plan, int rank) {
  if (!plan.saved) return "not saved";
  if (plan.states.empty()) {
    derive_rng_states(plan.base, rank);
    return "derived";
  }
  for (const auto& [name, state] : plan.states) set_rng_state(name, state);
  return "restored";
}

void check_sampler(const Manifest& m, const data::DistributedSampler* sampler) {
  if (sampler == nullptr) return;
  FSDP_CHECK(m.data.has_value(), "checkpoint '", m.dir,
             "' holds no data sampler state (it was saved without SaveOptions::sampler_state), but "
             "LoadOptions::sampler asks to restore one: save with the sampler's state, or load without it.");
  data::DistributedSampler trial = *sampler;  // load_state's checks, on a copy
  trial.load_state(*m.data);
}
void read_rows(const Group& group, const std::string& call, const ErrorContext& caller, ShardReader& reader,
               const LoadOptions& options, const std::vector<FSDPModule>& models, const ReadFailure& failure) {
  try {
    agree(group, call, caller,
          options.in_place() ? "reading and verifying this rank's rows (in place)"
                             : "reading and verifying this rank's rows",
          reader.reads_in_place() ? failure.overwritten : failure.left, [&] { reader.read(options.io_threads()); });
  } catch (...) {
    if (reader.reads_in_place()) {
      for (const auto& m : models) fsdp::detail::mark_broken(m, error_text(std::current_exception()), failure.remedy);
    }
    throw;
  }
}

Wanted wanted_buffer(const std::string& name, const at::Tensor& b) {
  return {"model/" + name, "buffer", b.scalar_type(), b.sizes().vec(), 0, b.dim() == 0 ? 1 : b.size(0), b};
}

}  // namespace fsdp::checkpoint::detail
