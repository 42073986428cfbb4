#include "checkpoint/internal/save_steps.h"

#include "checkpoint/commit.h"
#include "checkpoint/internal/crash_point.h"
#include "checkpoint/internal/manifest_builder.h"
#include "checkpoint/internal/optimizer_state.h"
#include "checkpoint/internal/replicas.h"
#include "checkpoint/internal/rng_state.h"
#include "checkpoint/manifest.h"
#include "checkpoint/plan.h"
#include "checkpoint/safetensors.h"
#include "fsdp/internal/check.h"
#include "fsdp/util/tensor_fingerprint.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <sstream>

namespace fsdp::checkpoint::detail {
namespace {

using json = nlohmann::ordered_json;

// A chunk of fewer than this many blocks of block_bytes gets smaller blocks (checksum_block): a
// load on another number of ranks reads at most about 1/64th of a chunk beyond its need at each
// end of what it needs, so that what it reads stays within 1.05 x what it needs.
constexpr uint64_t kMinBlocks = 64;

std::string rank_file(int rank) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "rank-%05d.safetensors", rank);
  return buf;
}

// Rows [first, first + n) of a tensor's dim 0 (a scalar is its one row).
at::Tensor rows_of(const at::Tensor& t, int64_t first, int64_t n) {
  return t.dim() == 0 ? t : t.narrow(0, first, n);
}

// The model's parameter that the optimizer's `param` is: its index in `specs`.
std::map<const void*, size_t> spec_index(const std::vector<ShardSpec>& specs) {
  std::map<const void*, size_t> out;
  for (size_t i = 0; i < specs.size(); ++i) out[specs[i].local.unsafeGetTensorImpl()] = i;
  return out;
}

// Rank 0's record of the optimizer: its type and each param group's hyperparameters and
// parameters (by name); the steps come from every rank's part (manifest_builder.h).
json optimizer_record(const std::vector<ShardSpec>& specs, const torch::optim::Optimizer& opt,
                      const std::string& type) {
  const auto index = spec_index(specs);
  json groups = json::array();
  for (const auto& group : opt.param_groups()) {
    json names = json::array();
    for (const auto& param : group.params()) names.push_back(specs[index.at(param.unsafeGetTensorImpl())].name);
    groups.push_back({{"options", detail::group_options(group, type)}, {"params", names}});
  }
  return {{"type", type}, {"param_groups", groups}};
}

// Every rank compares every tensor-parallel group's fingerprints of what its ranks hold alike
// (parameters no SplitModule splits), so that all fail together: one of them writes such a
// parameter's rows for all, which is only right when their values are the same.
void check_held_alike(const Group& group, const std::string& call, const ErrorContext& caller,
                      const std::vector<std::vector<int>>& tp_ranks, const std::vector<std::string>& alike) {
  const auto& global = group.global_ranks();
  for (size_t r = 0; r < alike.size(); ++r) {
    for (const int peer : tp_ranks[r]) {
      const auto q = static_cast<size_t>(std::find(global.begin(), global.end(), peer) - global.begin());
      if (q >= alike.size() || alike[q] == alike[r]) continue;
      FSDP_CHECK_IN(group.error_in(call + ": comparing what the tensor-parallel ranks hold alike", caller), false,
                    "parameter '", fsdp::util::first_difference(alike[r], alike[q]), "' differs between global ranks ",
                    global[r], " and ", peer,
                    " of one tensor-parallel group, though no fsdp::SplitModule declares it split: the checkpoint "
                    "would write its rows from one rank's values for all. Keep it alike on the tensor-parallel ranks "
                    "(its gradient summed over them, as fsdp::tp's layers do for what they hold whole), or declare it "
                    "split in its module's parameter_splits(); nothing was committed.");
    }
  }
}

// A new PreparedSave: where and under what name the save goes, its options, refusing those no save
// can run with before anything is read.
PreparedSave with_options(const std::string& root, const SaveOptions& options, int rank, int world_size) {
  PreparedSave p;
  p.root = root;
  p.name = checkpoint_name(options);
  p.rank = rank;
  p.world_size = world_size;
  p.options = options;
  FSDP_CHECK(options.io_threads() >= 1, "SaveOptions::io_threads is ", options.io_threads(),
             ": give at least 1 thread.");
  FSDP_CHECK(options.block_bytes() > 0,
             "SaveOptions::block_bytes is 0: each tensor's checksum is taken per block "
             "of that many bytes; give a positive size (the default is 1 MiB).");
  FSDP_CHECK(options.keep_last() >= 0, "SaveOptions::keep_last is ", options.keep_last(),
             ": give the number of newest checkpoints to keep, or 0 to keep all.");
  return p;
}

// Rank 0's part of the manifest that no rank's part says: each parameter's kind, dtype and shape,
// each unit's strategy and the optimizer's record.
void describe_model(PreparedSave& p, const FSDPModule& model, const std::vector<ShardSpec>& specs,
                    const torch::optim::Optimizer* opt, const std::string& type) {
  for (const auto& s : specs) {
    p.model_tensors.push_back({"model/" + s.name, "parameter", safetensors_dtype(s.dtype), place_of(s).shape});
  }
  for (const auto& u : model.units()) p.strategies[u.name.empty() ? "<root>" : u.name] = to_string(u.strategy);
  if (opt != nullptr) p.optimizer = optimizer_record(specs, *opt, type);
}

// Each parameter's optimizer state (in `specs`' order), which has its layout, so that this rank
// writes its rows of it; the steps go to `steps`. Refuses a parameter that is not the model's.
std::vector<detail::ParamState> optimizer_states(const std::vector<ShardSpec>& specs,
                                                 const torch::optim::Optimizer* opt, const std::string& type,
                                                 std::vector<std::pair<std::string, int64_t>>& steps) {
  std::vector<detail::ParamState> states(specs.size());
  if (opt == nullptr) return states;
  const auto index = spec_index(specs);
  for (const auto& group : opt->param_groups()) {
    for (const auto& param : group.params()) {
      const auto it = index.find(param.unsafeGetTensorImpl());
      FSDP_CHECK(it != index.end(), "the optimizer holds a parameter of shape ", param.sizes(),
                 " that is not one of the wrapped model's: build the optimizer on the wrapped model's parameters "
                 "(model->parameters() after fsdp::fully_shard).");
      const ShardSpec& s = specs[it->second];
      detail::ParamState st = detail::param_state(*opt, type, param);
      for (const auto& [name, t] : st.tensors) {
        FSDP_CHECK(t.sizes() == s.local.sizes() && t.scalar_type() == s.dtype && t.device() == s.local.device(),
                   "the optimizer's '", name, "' of parameter '", s.name, "' is ", t.scalar_type(), " ", t.sizes(),
                   " but this rank's rows of the parameter are ", s.dtype, " ", s.local.sizes(),
                   ": it does not have the parameter's layout.");
      }
      if (st.step >= 0) steps.emplace_back(s.name, st.step);
      states[it->second] = std::move(st);
    }
  }
  return states;
}

// The fingerprints of the parameters this rank's tensor-parallel ranks hold alike (not split),
// which the save compares across them before writing (check_held_alike).
std::string held_alike_lines(const std::vector<ShardSpec>& specs) {
  std::vector<std::pair<std::string, at::Tensor>> alike;
  for (const auto& s : specs) {
    if (s.tp_size > 1 && !s.tp.split()) alike.emplace_back(s.name, s.local);
  }
  return fsdp::util::fingerprint_lines(alike);
}

// The tensors only the ranks' parts describe, each described once (by its parameter's first write).
enum Described : size_t { kOptimizer, kOuter, kReplicaOptimizer, kReplica, kDescribedKinds };

// This rank's file, entry by entry, in the order it is written (PreparedSave's keys, rows, inners
// and tensors), and what its part of the manifest says of the tensors only it describes.
struct FileEntries {
  PreparedSave& p;
  const std::vector<ShardSpec>& specs;
  std::vector<std::vector<bool>> described =
      std::vector<std::vector<bool>>(kDescribedKinds, std::vector<bool>(specs.size(), false));

  // One entry: rows [b, e) of `key` within `inner`, named in the file "model/w[0:4]", a part of the
  // width "model/w[0:4, 8:16]".
  void add(const std::string& key, int64_t b, int64_t e, const at::Tensor& data, const InnerBox& inner = {}) {
    p.keys.push_back(key);
    p.rows.emplace_back(b, e);
    p.inners.push_back(inner);
    const std::string text = inner_text(inner);  // "[8:16]"
    const std::string box = inner.whole() ? "" : ", " + text.substr(1, text.size() - 2);
    p.tensors.emplace_back(key + "[" + std::to_string(b) + ":" + std::to_string(e) + box + "]", data);
  }

  // `tensors` (name, this rank's rows) of parameter w.spec, under `prefix`, as `kind`.
  void add_states(const WriteChunk& w, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                  const std::string& prefix, const char* kind, Described which) {
    const ShardSpec& s = specs[w.spec];
    for (const auto& [name, t] : tensors) {
      const std::string key = prefix + s.name + "/" + name;
      if (!described[which][w.spec])
        p.extra_tensors.push_back({key, kind, safetensors_dtype(t.scalar_type()), place_of(s).shape});
      add(key, w.row_begin, w.row_end, rows_of(t.detach(), w.local_row, w.row_end - w.row_begin), w.inner);
    }
    described[which][w.spec] = true;
  }

  // The plan's rows of each parameter under "model/", with their optimizer states; while replicas
  // train apart, the global state and the outer optimizer's instead.
  void add_parameters(const std::vector<detail::ParamState>& states, const ReplicaSave* apart) {
    for (const auto& w : plan_writes(specs)) {
      const ShardSpec& s = specs[w.spec];
      // The global state in the parameters' dtype (the manifest's for "model/"; DiLoCo keeps it in fp32).
      const at::Tensor rows = apart ? apart->global[w.spec].to(s.dtype) : s.local;
      add("model/" + s.name, w.row_begin, w.row_end, rows_of(rows.detach(), w.local_row, w.row_end - w.row_begin),
          w.inner);
      if (!apart) add_states(w, states[w.spec].tensors, "optim/", "optimizer", kOptimizer);
      if (apart && apart->outer != nullptr) {
        add_states(w, detail::param_state(*apart->outer, apart->outer_type, apart->global[w.spec]).tensors, "outer/",
                   "outer", kOuter);
      }
    }
  }

  // A replica's own shards and optimizer state under "replica<r>/", written by its ranks alone.
  void add_replica_own(const std::vector<detail::ParamState>& states, const ReplicaSave& apart) {
    std::vector<ShardSpec> own = specs;  // this replica's rows, none held by another of its ranks
    for (auto& s : own) s.replicas = 1, s.replica_rank = 0;
    for (const auto& w : plan_writes(own)) {
      const ShardSpec& s = specs[w.spec];
      const std::string key = apart.prefix + "model/" + s.name;
      if (!described[kReplica][w.spec])
        p.extra_tensors.push_back({key, "replica", safetensors_dtype(s.dtype), place_of(s).shape});
      add(key, w.row_begin, w.row_end, rows_of(s.local.detach(), w.local_row, w.row_end - w.row_begin), w.inner);
      described[kReplica][w.spec] = true;
      add_states(w, states[w.spec].tensors, apart.prefix + "optim/", "replica-optimizer", kReplicaOptimizer);
    }
  }

  // Buffers: every rank holds them whole; their rows are split over all ranks like replicas'.
  void add_buffers(const FSDPModule& model) {
    size_t index = specs.size();
    for (const auto& kv : model.named_buffers()) {
      const at::Tensor& b = kv.value();
      const std::string key = "model/" + kv.key();
      const int64_t rows = b.dim() == 0 ? 1 : b.size(0);
      if (p.rank == 0) {
        p.model_tensors.push_back({key, "buffer", safetensors_dtype(b.scalar_type()), b.sizes().vec()});
      }
      const auto [first, last] = replica_part(rows, p.world_size, p.rank, index++);
      if (last > first) add(key, first, last, rows_of(b.detach(), first, last - first));
    }
  }

  // This rank's generators: its own, written by it alone.
  void add_generators() {
    for (const auto& [name, state] : detail::rng_states()) {
      const std::string key = detail::rng_prefix(p.rank) + name;
      p.extra_tensors.push_back({key, "rng", safetensors_dtype(state.scalar_type()), state.sizes().vec()});
      add(key, 0, state.size(0), state);
    }
  }
};

// Each rank's facts that every rank compares before anything is written: its data sampler's
// state ("none" without one), its tensor-parallel ranks, and the fingerprints of what they hold alike.
struct RankFacts {
  std::vector<std::string> states, alike;
  std::vector<std::vector<int>> tp_ranks;
};

// The facts as all_gather gave them: "<state>\x1e<tensor-parallel ranks>\x1e<fingerprints>" a rank.
RankFacts split_facts(const std::vector<std::string>& gathered, int W) {
  RankFacts f{std::vector<std::string>(W), std::vector<std::string>(W), std::vector<std::vector<int>>(W)};
  for (int r = 0; r < W; ++r) {
    const std::string& g = gathered[r];
    const size_t a = g.find('\x1e'), b = g.find('\x1e', a + 1);
    f.states[r] = g.substr(0, a);
    std::istringstream in(g.substr(a + 1, b - a - 1));
    for (int x = 0; in >> x;) f.tp_ranks[r].push_back(x);
    f.alike[r] = g.substr(b + 1);
  }
  return f;
}

// Rank 0's manifest header: the save's name, step, size, options and what rank 0 described.
ManifestHeader manifest_header(const PreparedSave& p, int W, const ordered_json& data) {
  ManifestHeader header;
  header.name = p.name;
  header.step = p.options.step();
  header.world_size = W;
  header.block_bytes = p.options.block_bytes();
  header.strategies = p.strategies;
  header.metadata = p.options.metadata();
  header.optimizer = p.optimizer;
  header.data = data;
  return header;
}

// One run of write_and_commit on this rank: how its errors and agreements name the save, its
// phases (each agreed by every rank of `group`), and its claim on the staging directory.
struct SaveRun {
  PreparedSave& p;
  const Group& group;
  const std::string& who;
  const int rank = group.rank(), W = group.size();
  // The save's call and directory, with which its errors begin (Group::error_in); `where` is the
  // same as text, this rank's name for the save in the collectives' descriptions.
  const ErrorContext caller = ErrorContext().api(who).path(p.root + "/" + p.name);
  const std::string where = fsdp::detail::error_caller(group.error_in("", caller));
  const std::string call = who + " of '" + p.root + "/" + p.name + "'";  // the same on every rank
  const std::string staging = staging_path(p.root, p.name);
  // This process's claim on the staging directory, released however the save ends.
  bool staged = false;

  SaveRun(PreparedSave& p, const Group& group, const std::string& who) : p(p), group(group), who(who) {}
  SaveRun(const SaveRun&) = delete;
  SaveRun& operator=(const SaveRun&) = delete;
  ~SaveRun() {
    if (staged) end_staging(p.root, p.name);
  }

  // Each phase ends with every rank agreeing that it went well: a failure anywhere is every
  // rank's error, and nothing is committed.
  void phase(const char* what, const std::function<void()>& fn,
             const char* consequence = "nothing was committed") const {
    detail::agree(group, call, caller, what, consequence, fn);
  }

  // Rank 0 claims the staging directory; `first` runs before, so that a rank that cannot prepare
  // fails every rank before anything is on disk.
  void stage(const std::function<void()>& first) {
    phase("creating the staging directory", [&] {
      if (first) first();
      if (rank == 0) {
        begin_staging(p.root, p.name);
        staged = true;
      }
      detail::crash_point("staged", rank);
    });
  }

  // The data sampler's state is global: every rank must save the same one (or none). Compared
  // before any file is written, so that every rank's error names the rank that differs; every rank
  // compares the same gathered states, so every rank fails alike without a further agreement. With
  // it, what the tensor-parallel ranks hold alike. Returns the state, for the manifest.
  ordered_json compare_ranks() const {
    const ordered_json data = p.options.sampler_state() ? sampler_state_json(*p.options.sampler_state()) : nullptr;
    std::string peers;
    for (const int g : p.tp_ranks) peers += std::to_string(g) + " ";
    const auto gathered = group.all_gather((data.is_null() ? "none" : data.dump()) + '\x1e' + peers + '\x1e' + p.alike,
                                           "the data sampler states for " + where);
    const RankFacts facts = split_facts(gathered, W);
    for (int r = 0; r < W; ++r) {
      FSDP_CHECK_IN(
          group.error_in(call + ": comparing the ranks' data sampler states", caller),
          facts.states[r] == facts.states[0], "the data sampler's state differs between ranks: rank 0 saves ",
          facts.states[0], ", rank ", r, " has ", facts.states[r],
          ". Pass SaveOptions::sampler_state on every rank, each sampler having taken the same global batches; "
          "nothing was committed.");
    }
    check_held_alike(group, call, caller, facts.tp_ranks, facts.alike);
    return data;
  }

  // This rank's file in the staging directory, on disk (fsynced) before the agreement; returns its
  // part of the manifest (its chunks, in the file's order), encoded for rank 0.
  std::string write_file(SaveResult& result) {
    std::string part;
    phase("writing this rank's file", [&] {
      // A model on a GPU: its chunks are copied to the host first (an AsyncSaver's snapshot already
      // is there), since the file is written from host memory.
      for (auto& kv : p.tensors) {
        if (!kv.second.is_cpu()) kv.second = kv.second.to(at::kCPU);
      }
      const std::string path = staging + "/" + rank_file(rank);
      const FileRecord file = write_safetensors(path, p.tensors, {{"rank", std::to_string(rank)}},
                                                WriteOptions()
                                                    .block_bytes(p.options.block_bytes())
                                                    .min_blocks(kMinBlocks)
                                                    .fsync(false)
                                                    .threads(p.options.io_threads())
                                                    .direct(p.options.direct_io()));
      detail::crash_point("data-written", rank);
      fsync_path(path);
      detail::crash_point("data-fsynced", rank);
      for (const auto& t : file.tensors) result.bytes_written += static_cast<int64_t>(t.end - t.begin);
      part = rank_part(file).encode();
    });
    return part;
  }

  // This rank's part of the manifest: its file, its chunks in the file's order, what only it
  // describes and its optimizer steps.
  RankPart rank_part(const FileRecord& file) const {
    RankPart mine;
    mine.file = rank_file(rank);
    mine.file_bytes = file.size;
    mine.tensors = p.extra_tensors;
    mine.steps = p.steps;
    for (size_t i = 0; i < p.keys.size(); ++i) {
      const auto& t = file.tensors[i];
      mine.chunks.push_back(
          {p.keys[i], p.rows[i].first, p.rows[i].second, p.inners[i], t.begin, t.end, t.block_bytes, t.crc32c});
    }
    return mine;
  }

  // Rank 0 commits, then removes what keep_last drops, then every rank agrees: a failure after the
  // commit (keep_last's, or a rank that died meanwhile) must not be reported as a save that
  // committed nothing, since the new checkpoint is the latest.
  void commit_manifest(const std::vector<std::string>& parts, const ordered_json& data, SaveResult& result) {
    bool committed = false;
    try {
      phase(
          "writing the manifest and committing",
          [&] {
            if (rank != 0) return;
            const ManifestHeader header = manifest_header(p, W, data);
            std::vector<RankPart> decoded;
            decoded.reserve(parts.size());
            for (size_t r = 0; r < parts.size(); ++r)
              decoded.push_back(RankPart::decode(parts[r], static_cast<int>(r)));
            const std::string manifest = assemble_manifest(header, p.model_tensors, decoded, result.bytes_total);
            write_atomically(staging, kManifest, manifest);
            commit(p.root, staging, p.name);
            committed = true;
            keep_last(p.root, p.options.keep_last());
          },
          "whether it was committed, rank 0's error says (fsdp::checkpoint::latest_checkpoint names the latest)");
    } catch (...) {
      if (!committed) throw;
      FSDP_CHECK_IN(group.error_in(call + ": after the commit", caller), false, "the checkpoint was committed ('",
                    p.root, "/", p.name,
                    "' is the latest), but what came after it failed: ", error_text(std::current_exception()));
    }
  }
};

}  // namespace

std::string checkpoint_name(const SaveOptions& options) {
  return options.name().empty() ? step_name(options.step()) : options.name();
}

int64_t PreparedSave::bytes() const {
  int64_t n = 0;
  for (const auto& kv : tensors) n += static_cast<int64_t>(kv.second.nbytes());
  return n;
}

PreparedSave prepare_save(const std::string& root, const FSDPModule& model, const torch::optim::Optimizer* opt,
                          const SaveOptions& options, int rank, int world_size) {
  PreparedSave p = with_options(root, options, rank, world_size);
  // An optimizer the format cannot hold is refused before anything is on disk.
  const std::string type = opt != nullptr ? detail::optimizer_type(*opt, "fsdp::checkpoint::save") : "";
  const auto specs = model.shard_specs();
  if (p.rank == 0) describe_model(p, model, specs, opt, type);
  const std::vector<detail::ParamState> states = optimizer_states(specs, opt, type, p.steps);
  p.tp_ranks = tensor_parallel_ranks(model);
  p.alike = held_alike_lines(specs);
  // Replicas that train apart (LocalSGD, DiLoCo: internal/replicas.h): "model/" holds the global
  // state, split over the replicas (they hold it alike); each replica's own shards and optimizer
  // state go under "replica<r>/", written by its ranks alone, never split over the replicas.
  const auto apart = replica_save(model, specs);
  if (apart) {
    for (const auto& [k, v] : apart->metadata) p.options.metadata()[k] = v;
  }
  FileEntries file{p, specs};
  file.add_parameters(states, apart ? &*apart : nullptr);
  if (apart) file.add_replica_own(states, *apart);
  file.add_buffers(model);
  if (options.rng_states()) file.add_generators();
  return p;
}

void add_generators(PreparedSave& p) {
  const std::vector<ShardSpec> none;
  FileEntries{p, none}.add_generators();
}

SaveResult write_and_commit(PreparedSave& p, const Group& group, const std::string& who,
                            const std::function<void()>& first) {
  const auto t0 = std::chrono::steady_clock::now();
  SaveRun run(p, group, who);
  run.stage(first);
  const ordered_json data = run.compare_ranks();
  SaveResult result;
  const std::string part = run.write_file(result);
  detail::crash_point("agreed", run.rank);
  const auto parts = group.gather_to_rank0(part, "gathering the manifest's parts for " + run.where);
  run.commit_manifest(parts, data, result);
  result.path = p.root + "/" + p.name;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace fsdp::checkpoint::detail
