// fsdp::checkpoint::load into a pipelined model's stages (checkpoint/pipelined.h): the manifest read
// once, each stage's tensors and optimizer state matched by name (internal/load_plan.h), every
// rank's bytes read and verified into host memory (or in place), and only when every rank of the
// world has done that without a fault do the stages change, as a single model's load.
//
// Why strictness needs the world: a stage holds part of the model, so "no tensor of the checkpoint
// the model lacks" is a question about every stage together. The first rank of each stage says
// which of the checkpoint's model tensors its stages hold (the stage's other ranks hold the same),
// every rank finds any that none holds, and every rank's error names them before anything is read.
#include "checkpoint/pipelined.h"

#include "checkpoint/commit.h"
#include "checkpoint/internal/collectives.h"
#include "checkpoint/internal/load_plan.h"
#include "checkpoint/internal/stage_states.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"

#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace fsdp::checkpoint {
namespace {

constexpr const char* kWho = "fsdp::checkpoint::load";

// The checkpoint's model tensors (keys under "model/"), in the manifest's order.
std::vector<std::string> model_keys(const Manifest& m) {
  std::vector<std::string> keys;
  for (const auto& t : m.tensors) {
    if (t.key.rfind("model/", 0) == 0) keys.push_back(t.key);
  }
  return keys;
}

// The model tensors no rank's stages hold, from each rank's marks ('1': held), as the
// refusal's text ("" when every one is held).
std::string unheld(const Manifest& m, const std::vector<std::string>& marks) {
  const auto keys = model_keys(m);
  std::vector<std::string> missing;
  for (size_t k = 0; k < keys.size(); ++k) {
    bool held = false;
    for (const auto& r : marks) held = held || (k < r.size() && r[k] == '1');
    if (!held) missing.push_back(keys[k]);
  }
  if (missing.empty()) return "";
  std::string text =
      "checkpoint '" + m.dir + "' holds " + std::to_string(missing.size()) + " model tensor(s) that no stage holds:";
  for (size_t i = 0; i < missing.size() && i < 10; ++i) text += (i ? "; " : " ") + missing[i];
  if (missing.size() > 10) text += "; ...";
  return text +
         ". Give every rank its stages, the stages together the model it was saved from (the same layers), or pass "
         "LoadOptions().strict(false); nothing was loaded.";
}

}  // namespace

LoadResult load(const std::string& path, const DeviceMesh& mesh, const std::vector<StageState>& stages,
                const LoadOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  const detail::Group group = detail::Group::world(mesh);
  const int rank = group.rank();
  const ErrorContext caller = ErrorContext().api(kWho).path(path);
  // The same on every rank (the agreements compare it).
  bool with_optimizers = false;
  for (const auto& s : stages) with_optimizers = with_optimizers || s.optimizer != nullptr;
  const std::string call = std::string(kWho) + " of '" + path + "' into pipeline stages" +
                           (options.sampler() != nullptr ? " with a data sampler to restore" : "") +
                           (options.strict() ? "" : " (not strict)");
  auto phase = [&](const char* what, const std::function<void()>& fn) {
    detail::agree(group, call, caller, what, "the stages were left as they were", fn);
  };

  Manifest m;
  std::vector<StageState> sorted;
  std::vector<detail::OptimizerPlan> optims;
  detail::RngPlan rng;
  std::unique_ptr<detail::ShardReader> reader;
  std::string marks;  // '1' for each of the checkpoint's model tensors this rank's stages hold
  phase("checking the checkpoint against the stages", [&] {
    FSDP_CHECK(options.io_threads() >= 1, "LoadOptions::io_threads is ", options.io_threads(),
               ": give at least 1 thread.");
    sorted = detail::checked_stages(stages, "load");
    for (const auto& s : sorted) {
      FSDP_CHECK((s.optimizer != nullptr) == with_optimizers, "stage ", s.index,
                 with_optimizers ? " has no optimizer but another stage has" : " has an optimizer",
                 ": give every stage its optimizer (StageState::optimizer), or none.");
    }
    m = read_manifest(resolve_checkpoint(path));
    for (const auto& t : m.tensors) {
      FSDP_CHECK(!with_optimizers || t.kind != "replica-optimizer", "checkpoint '", m.dir,
                 "' was saved by replicas that trained apart (fsdp::optim::LocalSGD or DiLoCo): their optimizer "
                 "states are each replica's own, which pipeline stages do not take. Load the stages without their "
                 "optimizers (the global state), or load it into one model.");
    }
    std::vector<detail::ReadTarget> targets;
    std::set<std::string> held;
    for (const StageState& s : sorted) {
      const std::vector<ShardSpec> specs = s.model.shard_specs();
      std::vector<detail::Wanted> wanted;
      std::set<std::string> names;
      for (const ShardSpec& spec : specs) {
        wanted.push_back(detail::wanted_of(spec, "model/" + spec.name, "parameter", spec.local));
        names.insert(spec.name);
      }
      for (const auto& kv : s.model.named_buffers()) wanted.push_back(detail::wanted_buffer(kv.key(), kv.value()));
      for (const auto& w : wanted) held.insert(w.key);
      const std::string hint = " (Stage " + std::to_string(s.index) + ".)";
      for (auto& t : detail::match(m, wanted, /*strict=*/false, hint)) targets.push_back(std::move(t));
      if (s.optimizer == nullptr) continue;
      std::vector<detail::Wanted> state;
      optims.push_back(detail::plan_optimizer(m, specs, *s.optimizer, state, "optim/", "optimizer", &names));
      for (auto& t : detail::match(m, state, /*strict=*/false, hint)) targets.push_back(std::move(t));
    }
    if (options.rng_states()) {
      std::vector<detail::Wanted> generators;
      rng = detail::plan_rng(m, rank, generators);
      for (auto& t : detail::match(m, generators, /*strict=*/false, "")) targets.push_back(std::move(t));
    }
    // Whether this rank's stages load optimizers, then (from the stages' first ranks: one stage mesh
    // for all of this rank's stages) which of the checkpoint's model tensors they hold.
    marks = with_optimizers ? "O" : "N";
    if (options.strict() && detail::Group::of(sorted.front().model).rank() == 0) {
      for (const auto& key : model_keys(m)) marks += held.count(key) == 1 ? '1' : '0';
    }
    reader = std::make_unique<detail::ShardReader>(m, std::move(targets), options.in_place());
    reader->open_files();
    detail::check_sampler(m, options.sampler());
  });
  const auto all = group.all_gather(marks, "the stages' tensors for " + call);
  phase("checking the stages against each other", [&] {
    for (size_t r = 0; r < all.size(); ++r) {
      FSDP_CHECK(all[r].at(0) == marks.at(0), "global rank ", r, "'s stages load ",
                 all[r].at(0) == 'O' ? "their optimizers" : "no optimizer", " but this rank's ",
                 with_optimizers ? "do" : "do not",
                 ": give every stage its optimizer (StageState::optimizer), or none.");
    }
    if (!options.strict()) return;
    std::vector<std::string> held;
    for (const auto& r : all) held.push_back(r.substr(1));
    const std::string fault = unheld(m, held);
    FSDP_CHECK(fault.empty(), fault);
  });
  std::vector<FSDPModule> models;
  for (const auto& s : sorted) models.push_back(s.model);
  detail::read_rows(group, call, caller, *reader, options, models,
                    {"the stages were left as they were",
                     "this rank's shards were partly overwritten (LoadOptions::in_place), so the stages are now "
                     "unusable: build them again and load a good checkpoint",
                     "a load with LoadOptions::in_place failed after reading into the stages' shards, so they hold a "
                     "mix of values: build the stages again and load a good checkpoint (docs/usage.md, 'Loading in "
                     "place')"});
  // Every rank has its bytes, verified: now the stages (and their optimizers) change.
  reader->apply();
  size_t next = 0;
  for (auto& s : sorted) {
    s.model.mark_shards_written();
    if (s.optimizer != nullptr) detail::install(m, *s.optimizer, optims[next++]);
  }
  if (options.sampler() != nullptr) options.sampler()->load_state(*m.data);
  LoadResult r = detail::result_of(m, reader->stats());
  r.rng = options.rng_states() ? detail::apply_rng(rng, rank) : "not loaded";
  r.bytes_needed_total = r.bytes_read_total = 0;
  for (const auto& text : group.all_gather(std::to_string(r.bytes_needed) + " " + std::to_string(r.bytes_read),
                                           "the load's totals for " + call)) {
    const size_t space = text.find(' ');
    r.bytes_needed_total += std::stoll(text.substr(0, space));
    r.bytes_read_total += std::stoll(text.substr(space + 1));
  }
  r.seconds = detail::since(t0);
  return r;
}

}  // namespace fsdp::checkpoint
