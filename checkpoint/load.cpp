// fsdp::checkpoint::load: every rank reads the manifest, checks it against the model, reads and
// verifies the bytes of the rows it holds (internal/reader.h), and only when every rank has done
// all that without a fault are the shards written. A plain module is loaded the same way, whole.
#include "checkpoint/checkpoint.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"

#include "checkpoint/commit.h"
#include "checkpoint/internal/collectives.h"
#include "checkpoint/internal/load_plan.h"
#include "checkpoint/internal/optimizer_state.h"
#include "checkpoint/internal/reader.h"
#include "checkpoint/internal/replicas.h"
#include "checkpoint/internal/safetensors_manifest.h"
#include "checkpoint/manifest.h"

#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <functional>
#include <set>

namespace fsdp::checkpoint {
namespace {

using detail::OptimizerPlan;
using detail::RngPlan;
using detail::Wanted;

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
  auto phase = [&](const char* what, const std::function<void()>& fn) {
    detail::agree(group, call, caller, what, "the model was left as it was", fn);
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
      wanted.push_back(detail::wanted_of(s, replicas.model_prefix + s.name, replicas.model_kind, s.local));
    }
    for (const auto& kv : model.named_buffers()) wanted.push_back(detail::wanted_buffer(kv.key(), kv.value()));
    // The model first: a different model is reported as one, not as its optimizer's groups.
    auto targets = detail::match(m, wanted, options.strict(), "", replicas.model_prefix);
    std::vector<Wanted> more;
    if (opt != nullptr)
      optim = detail::plan_optimizer(m, specs, *opt, more, replicas.optim_prefix, replicas.optim_kind);
    // DiLoCo's global shards come from the global state, "model/", whatever the replicas.
    for (size_t i = 0; i < replicas.global.size(); ++i) {
      more.push_back(detail::wanted_of(specs[i], "model/" + specs[i].name, "parameter", replicas.global[i]));
    }
    if (!replicas.outer_type.empty()) outer = detail::plan_outer(m, specs, replicas, more);
    if (options.rng_states()) rng = detail::plan_rng(m, rank, more);
    for (auto& t : detail::match(m, more, /*strict=*/false, "")) targets.push_back(std::move(t));
    reader = std::make_unique<detail::ShardReader>(m, std::move(targets), options.in_place());
    reader->open_files();
    detail::check_sampler(m, options.sampler());
  });
  detail::read_rows(
      group, call, caller, *reader, options, {model},
      {"the model was left as it was",
       "this rank's shards were partly overwritten (LoadOptions::in_place), so the model is now unusable: "
       "build it again and load a good checkpoint",
       "a load with LoadOptions::in_place failed after reading into this model's shards, so they hold a "
       "mix of values: build the model again and load a good checkpoint (docs/usage.md, 'Loading in "
       "place')"});
  // Every rank has its bytes, verified: now the model (and the optimizer) change.
  reader->apply();
  model.mark_shards_written();  // ZeRO-1: the full parameters are gathered again from the rows
  if (opt != nullptr) detail::install(m, *opt, optim);
  for (const auto& p : outer.params) {
    detail::install_state(*replicas.outer, outer.type, p.param, p.names, p.dst, p.step);
  }
  detail::finish_replica_load(replicas, model);
  if (options.sampler() != nullptr) options.sampler()->load_state(*m.data);
  const std::string rng_outcome = options.rng_states() ? detail::apply_rng(rng, rank) : "not loaded";

  LoadResult r = detail::result_of(m, reader->stats());
  r.rng = rng_outcome;
  r.replicas = replicas.outcome;
  at::Tensor totals = at::tensor({r.bytes_needed, r.bytes_read}, at::kLong);
  fsdp::detail::all_reduce(model, totals, c10d::ReduceOp::SUM, call + ": totals", fsdp::detail::Span::kModel);
  r.bytes_needed_total = totals[0].item<int64_t>();
  r.bytes_read_total = totals[1].item<int64_t>();
  r.seconds = detail::since(t0);
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
    for (const auto& kv : module.named_buffers()) wanted.push_back(detail::wanted_buffer(kv.key(), kv.value()));
    detail::ShardReader reader(
        m, detail::match(m, wanted, options.strict(),
                         " (If the module is wrapped by fsdp::fully_shard, pass the wrapped model: the "
                         "module itself holds shards.)"));
    reader.open_files();
    reader.read();
    detail::check_sampler(m, options.sampler());
    reader.apply();
    if (options.sampler() != nullptr) options.sampler()->load_state(*m.data);
    LoadResult r = detail::result_of(m, reader.stats());
    r.seconds = detail::since(t0);
    return r;
  } catch (const c10::Error& e) {
    FSDP_CHECK(false, "fsdp::checkpoint::load of '", path, "' into a plain module: ", e.what_without_backtrace());
  }
}

}  // namespace fsdp::checkpoint
