// fsdp::checkpoint::load: every rank reads the manifest, checks it against the model, reads and
// verifies the bytes of the rows it holds (internal/reader.h), and only when every rank has done
// all that without a fault are the shards written. A plain module is loaded the same way, whole.
#include "checkpoint/checkpoint.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"

#include "checkpoint/commit.h"
#include "checkpoint/internal/collectives.h"
#include "checkpoint/internal/optimizer_state.h"
#include "checkpoint/internal/reader.h"
#include "checkpoint/internal/replicas.h"
#include "checkpoint/internal/rng_state.h"
#include "checkpoint/internal/safetensors_manifest.h"
#include "checkpoint/manifest.h"
#include "checkpoint/plan.h"
#include "checkpoint/safetensors.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <set>
#include <sstream>

namespace fsdp::checkpoint {
namespace {

// One tensor of the model: where its rows go.
struct Wanted {
  std::string key;   // "model/<name>"
  std::string kind;  // "parameter", "buffer"
  at::ScalarType dtype;
  std::vector<int64_t> shape;  // global
  int64_t row_begin = 0, row_end = 0;
  at::Tensor dst;
  InnerBox inner;  // along the dimensions from 1 (a tensor-parallel part); whole otherwise
};

// Where a parameter's rows on this rank go (its tensor-parallel part's place in the whole tensor).
Wanted wanted_of(const ShardSpec& s, const std::string& key, const std::string& kind, const at::Tensor& dst) {
  const TensorPlace place = place_of(s);
  return {key, kind,       s.dtype, place.shape, place.row_offset + s.row_begin, place.row_offset + s.row_end,
          dst, place.inner};
}

std::string describe(const std::string& dtype, const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << dtype << " " << c10::IntArrayRef(shape);
  return os.str();
}

// Checks `wanted` against the manifest (all of it, so that one error lists every difference) and
// turns it into the reader's targets. No byte of data is read.
// `strict`: no tensor under `prefix` the model lacks ("model/", or a replica's "replica<r>/model/").
std::vector<detail::ReadTarget> match(const Manifest& m, const std::vector<Wanted>& wanted, bool strict,
                                      const std::string& hint, const std::string& prefix = "model/") {
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < m.tensors.size(); ++i) index[m.tensors[i].key] = i;
  std::vector<std::string> missing, different, unexpected;
  std::set<std::string> seen;
  std::vector<detail::ReadTarget> targets;
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

int64_t file_bytes(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : 0;
}

LoadResult result_of(const Manifest& m, const detail::ReadStats& s) {
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

// A load's plan for the optimizer: per parameter of it, the saved state's names, where they go and
// the step; per param group the saved hyperparameters.
struct OptimizerPlan {
  std::string type;
  struct Param {
    at::Tensor param;
    std::vector<std::string> names;
    std::vector<at::Tensor> dst;
    int64_t step = -1;
  };
  std::vector<Param> params;
};

// Checks the saved optimizer against `opt` (type, param groups by parameter name, state names)
// and adds the state tensors to `wanted`. Nothing of the optimizer changes.
// `prefix` and `kind`: where its state is ("optim/", or a replica's "replica<r>/optim/").
OptimizerPlan plan_optimizer(const Manifest& m, const std::vector<ShardSpec>& specs, const torch::optim::Optimizer& opt,
                             std::vector<Wanted>& wanted, const std::string& prefix, const std::string& kind) {
  OptimizerPlan plan;
  plan.type = detail::optimizer_type(opt, "fsdp::checkpoint::load");
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
  const auto allowed = detail::state_names(plan.type);
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
      p.dst = detail::state_destinations(opt, plan.type, param, p.names);
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
    const auto& want = m.optimizer.param_groups[g].params;
    if (names != want) {
      const std::set<std::string> have(names.begin(), names.end()), saved_set(want.begin(), want.end());
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
                 missing.empty() && extra.empty() ? "; the same parameters in another order" : "",
                 "): build the optimizer with the param groups it was saved with.");
    }
  }
  for (const auto& kv : saved) {
    FSDP_CHECK(in_groups.count(kv.first) == 1, "checkpoint '", m.dir, "' holds optimizer state of '", kv.first,
               "', which is in none of the optimizer's param groups.");
  }
  return plan;
}

// DiLoCo's outer optimizer over its global shards (internal/replicas.h): its state from
// "outer/<name>/<state>", its steps from the metadata; its hyperparameters are the program's.
OptimizerPlan plan_outer(const Manifest& m, const std::vector<ShardSpec>& specs, const detail::ReplicaLoad& r,
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
    p.dst = detail::state_destinations(*r.outer, plan.type, p.param, p.names);
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
  for (const auto& p : plan.params) detail::install_state(opt, plan.type, p.param, p.names, p.dst, p.step);
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    detail::set_group_options(opt.param_groups()[g], plan.type, m.optimizer.param_groups[g].options,
                              "fsdp::checkpoint::load");
  }
}

// This rank's generator states to load, or the checksum its own derive from.
struct RngPlan {
  std::vector<std::pair<std::string, at::Tensor>> states;  // name, destination
  bool saved = false;                                      // the checkpoint has generator states
  uint32_t base = 0;                                       // rank 0's CPU state's first checksum
};

RngPlan plan_rng(const Manifest& m, int rank, std::vector<Wanted>& wanted) {
  RngPlan plan;
  const std::string mine = detail::rng_prefix(rank), first = detail::rng_prefix(0) + "cpu";
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
    detail::derive_rng_states(plan.base, rank);
    return "derived";
  }
  for (const auto& [name, state] : plan.states) detail::set_rng_state(name, state);
  return "restored";
}

// Checks that `sampler` (when given) can resume at the checkpoint's state, leaving it unchanged.
void check_sampler(const Manifest& m, const data::DistributedSampler* sampler) {
  if (sampler == nullptr) return;
  FSDP_CHECK(m.data.has_value(), "checkpoint '", m.dir,
             "' holds no data sampler state (it was saved without SaveOptions::sampler_state), but "
             "LoadOptions::sampler asks to restore one: save with the sampler's state, or load without it.");
  data::DistributedSampler trial = *sampler;  // load_state's checks, on a copy
  trial.load_state(*m.data);
}

LoadResult load_checkpoint(const std::string& path, FSDPModule& model, torch::optim::Optimizer* opt,
                           const LoadOptions& options,
                           const std::function<std::string(const std::string&)>* hf_names = nullptr) {
  const auto t0 = std::chrono::steady_clock::now();
  // Every rank of the model's checkpoint group (a tensor-parallel model's: the mesh's world).
  const detail::Group group = detail::Group::of(model);
  const int rank = group.rank();
  const ErrorContext caller = ErrorContext().api("fsdp::checkpoint::load").path(path);
  // The same on every rank (the agreements compare it): a sampler restored on some ranks only is
  // refused with the first agreement.
  const std::string call = "fsdp::checkpoint::load of '" + path + "'" +
                           (options.sampler() != nullptr ? " with a data sampler to restore" : "");
  // Every phase ends with every rank agreeing that it went well, so that a fault on one rank
  // leaves the model untouched on all: nothing is written before the last agreement.
  auto phase = [&](const char* what, const std::function<void()>& fn,
                   const char* consequence = "the model was left as it was") {
    detail::agree(group, call, caller, what, consequence, fn);
  };

  Manifest m;
  OptimizerPlan optim, outer;
  detail::ReplicaLoad replicas;
  RngPlan rng;
  std::unique_ptr<detail::ShardReader> reader;
  phase("checking the checkpoint against the model", [&] {
    FSDP_CHECK(options.io_threads() >= 1, "LoadOptions::io_threads is ", options.io_threads(),
               ": give at least 1 thread.");
    FSDP_CHECK(!model.step_in_progress(),
               "a step is under way (a forward ran with gradients and its backward has not, or this is inside the "
               "forward or the backward): load between steps, after the optimizer's step and before the next "
               "forward; a forward that needs no backward runs under torch::NoGradGuard.");
    if (hf_names != nullptr) {
      std::set<std::string> buffers;
      for (const auto& kv : model.named_buffers()) buffers.insert(kv.key());
      m = detail::safetensors_manifest(path, buffers, *hf_names);
    } else {
      m = read_manifest(resolve_checkpoint(path));
    }
    std::vector<Wanted> wanted;
    const std::vector<ShardSpec> specs = model.shard_specs();  // the model's and the optimizer's
    // Replicas that train apart, or a checkpoint of such: which keys hold what (internal/replicas.h).
    replicas = detail::replica_load(m, model, specs);
    for (const ShardSpec& s : specs) {
      wanted.push_back(wanted_of(s, replicas.model_prefix + s.name, replicas.model_kind, s.local));
    }
    for (const auto& kv : model.named_buffers()) {
      const at::Tensor& b = kv.value();
      wanted.push_back(
          {"model/" + kv.key(), "buffer", b.scalar_type(), b.sizes().vec(), 0, b.dim() == 0 ? 1 : b.size(0), b});
    }
    // The model first: a different model is reported as one, not as its optimizer's groups.
    auto targets = match(m, wanted, options.strict(), "", replicas.model_prefix);
    std::vector<Wanted> more;
    if (opt != nullptr) optim = plan_optimizer(m, specs, *opt, more, replicas.optim_prefix, replicas.optim_kind);
    // DiLoCo's global shards come from the global state, "model/", whatever the replicas.
    for (size_t i = 0; i < replicas.global.size(); ++i) {
      more.push_back(wanted_of(specs[i], "model/" + specs[i].name, "parameter", replicas.global[i]));
    }
    if (!replicas.outer_type.empty()) outer = plan_outer(m, specs, replicas, more);
    if (options.rng_states()) rng = plan_rng(m, rank, more);
    for (auto& t : match(m, more, /*strict=*/false, "")) targets.push_back(std::move(t));
    reader = std::make_unique<detail::ShardReader>(m, std::move(targets), options.in_place());
    reader->open_files();
    check_sampler(m, options.sampler());
  });
  // In place, the reads go into the shards: a failure anywhere leaves this rank's a mix (when it
  // read any in place), so the model is then marked unusable. The phase's name, compared across
  // ranks, says whether the load is in place; what this rank's error says of its shards is its own.
  try {
    phase(
        options.in_place() ? "reading and verifying this rank's rows (in place)"
                           : "reading and verifying this rank's rows",
        [&] { reader->read(options.io_threads()); },
        reader->reads_in_place() ? "this rank's shards were partly overwritten (LoadOptions::in_place), so the "
                                   "model is now unusable: build it again and load a good checkpoint"
                                 : "the model was left as it was");
  } catch (...) {
    if (reader->reads_in_place()) {
      fsdp::detail::mark_broken(
          model, error_text(std::current_exception()),
          "a load with LoadOptions::in_place failed after reading into this model's shards, so they hold a mix of "
          "values: build the model again and load a good checkpoint (docs/usage.md, 'Loading in place')");
    }
    throw;
  }
  // Every rank has its bytes, verified: now the model (and the optimizer) change.
  reader->apply();
  model.mark_shards_written();  // ZeRO-1: the full parameters are gathered again from the rows
  if (opt != nullptr) install(m, *opt, optim);
  for (const auto& p : outer.params) {
    detail::install_state(*replicas.outer, outer.type, p.param, p.names, p.dst, p.step);
  }
  detail::finish_replica_load(replicas, model);
  if (options.sampler() != nullptr) options.sampler()->load_state(*m.data);
  const std::string rng_outcome = options.rng_states() ? apply_rng(rng, rank) : "not loaded";

  LoadResult r = result_of(m, reader->stats());
  r.rng = rng_outcome;
  r.replicas = replicas.outcome;
  at::Tensor totals = at::tensor({r.bytes_needed, r.bytes_read}, at::kLong);
  fsdp::detail::all_reduce(model, totals, c10d::ReduceOp::SUM, call + ": totals", fsdp::detail::Span::kModel);
  r.bytes_needed_total = totals[0].item<int64_t>();
  r.bytes_read_total = totals[1].item<int64_t>();
  r.seconds = since(t0);
  return r;
}

}  // namespace

LoadResult load(const std::string& path, FSDPModule& model, const LoadOptions& options) {
  return load_checkpoint(path, model, nullptr, options);
}

LoadResult load(const std::string& path, FSDPModule& model, torch::optim::Optimizer& optimizer,
                const LoadOptions& options) {
  return load_checkpoint(path, model, &optimizer, options);
}

LoadResult load_safetensors(const std::string& path, FSDPModule& model, const LoadOptions& options,
                            const std::function<std::string(const std::string&)>& name_map) {
  FSDP_CHECK(options.sampler() == nullptr, "fsdp::checkpoint::load_safetensors of '", path,
             "': Hugging Face weights hold no data sampler state; pass LoadOptions without sampler.");
  LoadOptions o = options;
  o.rng_states(false);
  return load_checkpoint(path, model, nullptr, o, &name_map);
}

LoadResult load(const std::string& path, torch::nn::Module& module, const LoadOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    const Manifest m = read_manifest(resolve_checkpoint(path));
    std::vector<Wanted> wanted;
    std::set<const void*> seen;  // a tied weight is saved once, under its first name
    for (const auto& kv : module.named_parameters()) {
      const at::Tensor& p = kv.value();
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      wanted.push_back(
          {"model/" + kv.key(), "parameter", p.scalar_type(), p.sizes().vec(), 0, p.dim() == 0 ? 1 : p.size(0), p});
    }
    for (const auto& kv : module.named_buffers()) {
      const at::Tensor& b = kv.value();
      wanted.push_back(
          {"model/" + kv.key(), "buffer", b.scalar_type(), b.sizes().vec(), 0, b.dim() == 0 ? 1 : b.size(0), b});
    }
    detail::ShardReader reader(m, match(m, wanted, options.strict(),
                                        " (If the module is wrapped by fsdp::fully_shard, pass the wrapped model: the "
                                        "module itself holds shards.)"));
    reader.open_files();
    reader.read();
    check_sampler(m, options.sampler());
    reader.apply();
    if (options.sampler() != nullptr) options.sampler()->load_state(*m.data);
    LoadResult r = result_of(m, reader.stats());
    r.seconds = since(t0);
    return r;
  } catch (const c10::Error& e) {
    FSDP_CHECK(false, "fsdp::checkpoint::load of '", path, "' into a plain module: ", e.what_without_backtrace());
  }
}

}  // namespace fsdp::checkpoint
