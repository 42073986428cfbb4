// fsdp::checkpoint::save of a pipelined model (checkpoint/pipelined.h): one checkpoint of the whole
// model from the stages every rank holds, each stage's part prepared as a single model's save over
// the stage's ranks (internal/save_steps.h: its rows of each parameter, optimizer state and buffer),
// then written as one file per rank and committed with one manifest over the mesh's world.
//
// Why the stages describe themselves to every rank: the manifest needs every stage's tensors, units
// and optimizer (rank 0 holds one stage only), and a tensor two stages hold (a tied embedding on the
// first and last) must be written once. Each stage's first rank sends its description; every rank
// gets them all (names and shapes, no data), so that each drops what an earlier stage writes and
// rank 0 writes the manifest's model and optimizer from them, all before anything is on disk. The
// copies of such a tensor are compared first (a fingerprint of each rank's rows): the checkpoint
// keeps one value, which must be what every stage holds.
#include "checkpoint/pipelined.h"

#include "checkpoint/internal/collectives.h"
#include "checkpoint/internal/save_steps.h"
#include "checkpoint/internal/stage_states.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"
#include "fsdp/util/tensor_fingerprint.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace fsdp::checkpoint {
namespace {

using json = nlohmann::ordered_json;

constexpr const char* kWho = "fsdp::checkpoint::save";

// One of this rank's stages, prepared as a single model's save over the stage's ranks.
struct StagePart {
  int64_t index = 0;
  int stage_rank = 0;  // in the stage's checkpoint group: its rank 0 describes the stage
  detail::PreparedSave part;
  std::vector<ShardSpec> specs;
};

// The stage's tensors (kind, dtype, shape, in the model's order), its units' strategies and its
// optimizer's record, as its first rank sends them.
json describe(const StagePart& s) {
  json tensors = json::array();
  for (const auto& t : s.part.model_tensors) tensors.push_back({t.key, t.kind, t.dtype, t.shape});
  return {{"index", s.index}, {"tensors", tensors}, {"strategies", s.part.strategies}, {"optimizer", s.part.optimizer}};
}

// The parameter or buffer a file entry's key belongs to: "model/<name>", "optim/<name>/<state>".
std::string tensor_of(const std::string& key) {
  if (key.rfind("model/", 0) == 0) return key.substr(6);
  if (key.rfind("optim/", 0) == 0) return key.substr(6, key.find_last_of('/') - 6);
  return "";
}

// Every stage's description, by index, from what every rank sent; checked: each stage described
// once (by its first rank), the indices 0 to S-1, a tensor held by two stages of one kind, dtype and
// shape, and every stage with an optimizer or none.
struct Described {
  std::map<int64_t, json> stages;
  // Each tensor's key with the first stage that holds it; the keys several stages hold.
  std::map<std::string, int64_t> first_holder;
  std::set<std::string> shared;
  std::vector<std::tuple<int64_t, int, bool>> others;  // stage, global rank, has an optimizer

  explicit Described(const std::vector<std::string>& sent) {
    for (size_t r = 0; r < sent.size(); ++r) {
      for (auto& d : json::parse(sent[r])) {
        const int64_t i = d.at("index").get<int64_t>();
        if (!d.contains("tensors")) {  // a stage's other rank: whether it has an optimizer
          others.emplace_back(i, static_cast<int>(r), d.at("optimizer").get<bool>());
          continue;
        }
        FSDP_CHECK(stages.count(i) == 0, "stage ", i,
                   " is described by two ranks as its stage's first: give each rank its own stages, each stage's "
                   "model wrapped over that stage's ranks (fsdp::pp::stage_mesh).");
        stages[i] = std::move(d);
      }
    }
    FSDP_CHECK(!stages.empty(),
               "no rank described a stage as its stage's first rank: wrap each stage's model over "
               "its stage's ranks (fsdp::pp::stage_mesh).");
    int64_t expect = 0;
    for (const auto& [i, d] : stages) {
      FSDP_CHECK(i == expect, "no rank holds stage ", expect, " (the stages given are ", list(), "): every stage ",
                 "from 0 to the last must be some rank's.");
      ++expect;
    }
    const bool optimizer = !stages.begin()->second.at("optimizer").is_null();
    std::map<std::string, std::pair<int64_t, const json*>> seen;
    for (const auto& [i, d] : stages) {
      FSDP_CHECK(d.at("optimizer").is_null() != optimizer, "stage ", i,
                 optimizer ? " has no optimizer" : " has an optimizer", " but stage 0 ",
                 optimizer ? "has one" : "has none",
                 ": give every stage its optimizer (StageState::optimizer), or none.");
      for (const auto& [stage, rank, has] : others) {
        FSDP_CHECK(stage != i || has == optimizer, "global rank ", rank, " gives stage ", i,
                   has ? " an optimizer" : " no optimizer", " but the stage's first rank ",
                   optimizer ? "gives one" : "gives none",
                   ": give every rank of every stage its optimizer (StageState::optimizer), or none.");
      }
      for (const auto& t : d.at("tensors")) {
        const std::string key = t.at(0).get<std::string>();
        const auto [it, fresh] = seen.emplace(key, std::pair{i, &t});
        if (fresh) {
          first_holder[key] = i;
          continue;
        }
        shared.insert(key);
        FSDP_CHECK(*it->second.second == t, "stages ", it->second.first, " and ", i, " both hold '", key, "', as ",
                   it->second.second->dump(), " and ", t.dump(),
                   ": two stages hold one tensor only as one tied weight (the same kind, dtype and shape).");
      }
    }
  }

  std::string list() const {
    std::string s;
    for (const auto& kv : stages) s += (s.empty() ? "" : ", ") + std::to_string(kv.first);
    return s;
  }

  // Rank 0's part of the manifest that no rank's file says: the model's tensors (each once, in
  // stage order), the units' strategies, and the stages' optimizers as one.
  void describe_model(detail::PreparedSave& p) const {
    json groups = nullptr;
    std::string type;
    for (const auto& [i, d] : stages) {
      for (const auto& t : d.at("tensors")) {
        const std::string key = t.at(0).get<std::string>();
        if (first_holder.at(key) != i) continue;
        p.model_tensors.push_back(
            {key, t.at(1).get<std::string>(), t.at(2).get<std::string>(), t.at(3).get<std::vector<int64_t>>()});
      }
      for (const auto& [unit, strategy] : d.at("strategies").items()) {
        if (!p.strategies.contains(unit)) p.strategies[unit] = strategy;
      }
      const json& opt = d.at("optimizer");
      if (opt.is_null()) continue;
      if (groups.is_null()) {
        type = opt.at("type").get<std::string>();
        groups = opt.at("param_groups");
        continue;
      }
      merge_groups(i, opt, type, groups);
    }
    if (!groups.is_null()) p.optimizer = {{"type", type}, {"param_groups", groups}};
  }

  // Stage i's optimizer into the one before it: param group g the concatenation of every stage's
  // group g (a tied weight once), each group's options the same in every stage.
  void merge_groups(int64_t i, const json& opt, const std::string& type, json& groups) const {
    FSDP_CHECK(opt.at("type") == type, "stage ", i, "'s optimizer is ", opt.at("type").get<std::string>(),
               " but stage 0's is ", type, ": build every stage's optimizer alike (one type).");
    const json& mine = opt.at("param_groups");
    FSDP_CHECK(mine.size() == groups.size(), "stage ", i, "'s optimizer has ", mine.size(),
               " param group(s) but stage 0's has ", groups.size(),
               ": build every stage's optimizer alike, group g of each the same options, so that the checkpoint "
               "holds one optimizer over the whole model.");
    for (size_t g = 0; g < groups.size(); ++g) {
      FSDP_CHECK(mine[g].at("options") == groups[g].at("options"), "param group ", g, " of stage ", i,
                 "'s optimizer has options ", mine[g].at("options").dump(), " but stage 0's has ",
                 groups[g].at("options").dump(), ": build every stage's optimizer alike.");
      for (const auto& name : mine[g].at("params")) {
        if (first_holder.at("model/" + name.get<std::string>()) == i) groups[g]["params"].push_back(name);
      }
    }
  }
};

// This rank's rows of each tensor several stages hold, as "<stage> <global rank> <key> rows <b>:<e>
// part <p> <fingerprint>" lines: the ranks at one place of the stage meshes hold the same rows of a
// tied weight, which must be one value.
std::string tied_prints(const std::vector<StagePart>& parts, const std::set<std::string>& shared, int rank) {
  std::string out;
  for (const auto& s : parts) {
    for (const auto& spec : s.specs) {
      if (shared.count("model/" + spec.name) == 0) continue;
      const std::string where = "model/" + spec.name + " rows " + std::to_string(spec.row_begin) + ":" +
                                std::to_string(spec.row_end) + " part " + std::to_string(spec.tp.part);
      out += std::to_string(s.index) + " " + std::to_string(rank) + " " +
             fsdp::util::fingerprint_lines({{where, spec.local}});
    }
  }
  return out;
}

// Every rank's tied_prints compared: the same rows of one key equal in every stage.
void check_tied(const std::vector<std::string>& prints) {
  std::map<std::string, std::tuple<std::string, int64_t, int>> first;  // rows -> fingerprint, stage, rank
  for (const auto& text : prints) {
    std::istringstream in(text);
    int64_t stage = 0;
    int rank = 0;
    std::string key, rows, b_e, part, p, fp;
    while (in >> stage >> rank >> key >> rows >> b_e >> part >> p >> fp) {
      const std::string where = key + " rows " + b_e + " part " + p;
      const auto [it, fresh] = first.emplace(where, std::tuple{fp, stage, rank});
      if (fresh || std::get<0>(it->second) == fp) continue;
      FSDP_CHECK(false, "'", key.substr(6), "' (a tensor stages ", std::get<1>(it->second), " and ", stage,
                 " both hold: a tied weight) differs between them: rows ", b_e, " on global rank ",
                 std::get<2>(it->second), " and on global rank ", rank,
                 ". Keep the copies one value (sum their gradients before the optimizer's step, as one model's one "
                 "weight gets both uses' gradients); nothing was written.");
    }
  }
}

// Stage `s`'s entries appended to `p`'s file, less those of tensors an earlier stage writes.
void append(detail::PreparedSave& p, detail::PreparedSave& s, const std::set<std::string>& earlier) {
  for (size_t e = 0; e < s.keys.size(); ++e) {
    if (earlier.count(tensor_of(s.keys[e])) == 1) continue;
    p.keys.push_back(s.keys[e]);
    p.rows.push_back(s.rows[e]);
    p.inners.push_back(s.inners[e]);
    p.tensors.push_back(std::move(s.tensors[e]));
  }
  for (auto& t : s.extra_tensors) {
    if (earlier.count(tensor_of(t.key)) == 0) p.extra_tensors.push_back(std::move(t));
  }
  for (auto& st : s.steps) {
    if (earlier.count(st.first) == 0) p.steps.push_back(std::move(st));
  }
  p.alike += s.alike;
}

}  // namespace

SaveResult save(const std::string& root, const DeviceMesh& mesh, const std::vector<StageState>& stages,
                const SaveOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  const detail::Group group = detail::Group::world(mesh);
  detail::PreparedSave p;  // named now, for the errors of the first phase
  p.root = root;
  p.name = detail::checkpoint_name(options);
  const ErrorContext caller = ErrorContext().api(kWho).path(root + "/" + p.name);
  const std::string call = std::string(kWho) + " of pipeline stages to '" + root + "/" + p.name + "'";
  // Each stage's part, over its own ranks; a rank that cannot prepare fails every rank before the
  // descriptions are exchanged.
  std::vector<StagePart> parts;
  json mine = json::array();
  detail::agree(group, call, caller, "preparing this rank's stages", "nothing was written", [&] {
    SaveOptions per_stage = options;
    per_stage.rng_states(false);  // the rank's generators once, below
    for (const StageState& s : detail::checked_stages(stages, "save")) {
      const detail::Group stage = detail::Group::of(s.model);
      StagePart part{s.index, stage.rank(),
                     detail::prepare_save(root, s.model, s.optimizer, per_stage, stage.rank(), stage.size()),
                     s.model.shard_specs()};
      mine.push_back(part.stage_rank == 0 ? describe(part)
                                          : json{{"index", s.index}, {"optimizer", s.optimizer != nullptr}});
      parts.push_back(std::move(part));
    }
  });
  const std::vector<std::string> sent = group.all_gather(mine.dump(), "the pipeline stages' descriptions for " + call);
  // Every rank reads them (the same checks, so every rank fails alike), then says what it holds of
  // a tensor several stages hold.
  std::unique_ptr<Described> described;
  std::string prints;
  detail::agree(group, call, caller, "checking the stages' descriptions", "nothing was written", [&] {
    described = std::make_unique<Described>(sent);
    prints = tied_prints(parts, described->shared, group.rank());
  });
  const std::vector<std::string> tied = group.all_gather(prints, "the stages' tied weights for " + call);
  detail::agree(group, call, caller, "comparing the stages' copies of a tied weight", "nothing was written", [&] {
    check_tied(tied);
    detail::PreparedSave merged;
    merged.root = root;
    merged.name = p.name;
    merged.rank = group.rank();
    merged.world_size = group.size();
    merged.options = options;
    merged.tp_ranks = parts.front().part.tp_ranks;  // one stage mesh for all of this rank's stages
    for (StagePart& s : parts) {
      std::set<std::string> earlier;  // what an earlier stage writes
      for (const auto& [key, first] : described->first_holder) {
        if (first < s.index) earlier.insert(key.substr(6));
      }
      append(merged, s.part, earlier);
    }
    if (options.rng_states()) detail::add_generators(merged);
    described->describe_model(merged);  // on every rank, so that every rank's error says why (rank 0's is written)
    p = std::move(merged);
  });
  SaveResult r = detail::write_and_commit(p, group, kWho);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace fsdp::checkpoint
