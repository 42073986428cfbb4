// What the checkpoint tests share: a model with buffers (wrapped and plain, the same names), the
// strategy cases, the optimizers, a training step, bit-exact comparison, whole tensors read back
// from a checkpoint, and the ways to damage a copy of one.
#pragma once

#include "checkpoint/checkpoint.h"
#include "checkpoint/commit.h"
#include "checkpoint/internal/manifest_builder.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "optim/fused_adamw.h"
#include "tests/harness.h"
#include "tests/models.h"
#include "tests/temp_dir.h"

#include <torch/serialize.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::testing {

/// UnevenMLP with two buffers (one a scalar), which every rank holds whole; the plain one (no
/// fsdp::Sharded units) has the same names.
template <bool kSharded>
struct BufferedMLPT : UnevenMLPImpl<kSharded> {
  BufferedMLPT() {
    running = this->register_buffer("running", torch::arange(5.0) * 0.5);
    count = this->register_buffer("count", torch::tensor(7, torch::kLong));
  }
  torch::Tensor running, count;
};
using BufferedMLPImpl = BufferedMLPT<true>;
using PlainMLPImpl = BufferedMLPT<false>;

inline torch::OrderedDict<std::string, at::Tensor> state_of(const torch::nn::Module& m) {
  auto out = m.named_parameters();
  for (const auto& kv : m.named_buffers()) out.insert(kv.key(), kv.value());
  return out;
}

struct Case {
  const char* label;
  ShardingStrategy strategy;
  int group;  // hybrid's group size
  bool mixed;
};

// What each world size saves: every strategy, hybrid with a group that divides it, and a mix.
inline std::vector<Case> saved_cases(int W) {
  return {{"full", ShardingStrategy::kFullShard, 0, false},
          {"grad_op", ShardingStrategy::kShardGradOp, 0, false},
          {"zero1", ShardingStrategy::kShardOptimizerState, 0, false},
          {"replicate", ShardingStrategy::kNoShard, 0, false},
          {"hybrid", ShardingStrategy::kHybridShard, W % 2 == 0 ? 2 : 1, false},
          {"mixed", ShardingStrategy::kFullShard, 0, true}};
}

inline std::shared_ptr<BufferedMLPImpl> build(const Case& c, Rank& r, uint64_t seed) {
  torch::manual_seed(seed);
  auto net = std::make_shared<BufferedMLPImpl>();
  if (c.mixed) net->fc1->set_sharding_strategy(ShardingStrategy::kNoShard);
  (void)r;
  return net;
}

inline FullyShardedModule<BufferedMLPImpl> wrap(const Case& c, Rank& r, uint64_t seed) {
  return fsdp::fully_shard(build(c, r, seed), r.pg, test_options(c.strategy, c.group));
}

/// A temporary checkpoint root for a test's ranks: made by the test process (removed when the test
/// ends) and handed to the ranks in `options.env`, where root_dir() reads it. Unset in a rank.
struct CheckpointRoot {
  std::unique_ptr<TempDir> tmp;
  RunOptions options;
  CheckpointRoot() {
    if (in_rank_process()) return;
    tmp = std::make_unique<TempDir>();
    options.env["FSDP_TEST_CKPT_ROOT"] = tmp->path;
  }
  const std::string& path() const { return tmp->path; }
};

inline std::string root_dir() {
  const char* d = std::getenv("FSDP_TEST_CKPT_ROOT");
  TORCH_CHECK(d != nullptr, "FSDP_TEST_CKPT_ROOT is not set");
  return d;
}

inline std::string ckpt_name(int N, const Case& c) {
  return "n" + std::to_string(N) + "-" + c.label;
}

// The same weights as the checkpoint in every dict entry, bit for bit.
inline void expect_bit_exact(const torch::OrderedDict<std::string, at::Tensor>& got,
                             const torch::OrderedDict<std::string, at::Tensor>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& kv : want) {
    const at::Tensor* g = got.find(kv.key());
    ASSERT_NE(g, nullptr) << what << ": " << kv.key();
    EXPECT_EQ(g->scalar_type(), kv.value().scalar_type()) << what << ": " << kv.key();
    EXPECT_TRUE(g->sizes() == kv.value().sizes() && g->equal(kv.value())) << what << ": " << kv.key();
  }
}

inline torch::OrderedDict<std::string, at::Tensor> read_reference(const std::string& path) {
  torch::serialize::InputArchive in;
  in.load_from(path);
  torch::OrderedDict<std::string, at::Tensor> out;
  for (const auto& key : in.keys()) {
    at::Tensor t;
    in.read(key, t);
    out.insert(key, t);
  }
  return out;
}

inline int64_t rng_bytes() {
  return at::globalContext().defaultGenerator(at::Device(at::kCPU)).get_state().numel();
}

// The optimizers: SGD with momentum, AdamW and FusedAdamW (an AdamW: each loads the other's state).
enum class Opt { kSGD, kAdamW, kFused };
inline const char* opt_label(Opt o) {
  return o == Opt::kSGD ? "sgd" : o == Opt::kAdamW ? "adamw" : "fused";
}
inline Opt opt_of(int N, size_t i) {  // rotating with the world size, so that each case meets each optimizer
  return static_cast<Opt>((i + static_cast<size_t>(N)) % 3);
}
inline std::unique_ptr<torch::optim::Optimizer> make_opt(Opt o, const FSDPModule& model) {
  if (o == Opt::kSGD)
    return std::make_unique<torch::optim::SGD>(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  if (o == Opt::kAdamW)
    return std::make_unique<torch::optim::AdamW>(model.parameters(), torch::optim::AdamWOptions(0.02));
  return std::make_unique<optim::FusedAdamW>(model, torch::optim::AdamWOptions(0.02));
}

// One training step on the global batch of `step` (this rank's rows of it); the global loss.
template <typename Model>
double train_step(Model& model, torch::optim::Optimizer& opt, Rank& r, int step) {
  torch::manual_seed(100 + step);
  auto x = torch::randn({kGlobalBatch, 7});
  auto loss = model(local_rows(x, r.rank, r.world_size)).square().mean();
  loss.backward();
  opt.step();
  opt.zero_grad();
  at::Tensor l = loss.detach() / r.world_size;
  all_reduce_sum(r, l);
  return l.item<double>();
}

// Every tensor of a checkpoint, whole, read chunk by chunk (each into its rows and inner box).
inline std::map<std::string, at::Tensor> read_all(const std::string& dir) {
  const auto m = checkpoint::read_manifest(dir);
  std::map<std::string, at::Tensor> out;
  for (const auto& t : m.tensors) {
    const auto options = at::TensorOptions().dtype(checkpoint::scalar_type_of(t.dtype, t.key));
    at::Tensor full = at::empty(t.shape, options);
    for (const auto& c : t.chunks) {
      // The chunk as it lies in its file (its rows, within its inner box), then into its place.
      std::vector<int64_t> shape{c.row_end - c.row_begin};
      for (size_t d = 0; d + 1 < t.shape.size(); ++d) shape.push_back(c.inner.length(d, t.shape));
      if (t.shape.empty()) shape.clear();
      at::Tensor piece = at::empty(shape, options);
      checkpoint::read_bytes(dir + "/" + m.files[c.file].name, c.begin, c.end - c.begin,
                             static_cast<char*>(piece.data_ptr()));
      at::Tensor place = t.shape.empty() ? full : full.narrow(0, c.row_begin, c.row_end - c.row_begin);
      for (size_t d = 0; d < c.inner.offsets.size(); ++d) {
        place = place.narrow(static_cast<int64_t>(d + 1), c.inner.offsets[d], c.inner.lengths[d]);
      }
      place.copy_(piece);
    }
    out[t.key] = full;
  }
  return out;
}

// Copies checkpoint `from` to `to` (its files only), byte for byte.
inline void copy_checkpoint(const std::string& from, const std::string& to) {
  TORCH_CHECK(::mkdir(to.c_str(), 0755) == 0, "mkdir ", to);
  const auto m = checkpoint::read_manifest(from);
  std::vector<std::string> names{checkpoint::kManifest};
  for (const auto& f : m.files) names.push_back(f.name);
  for (const auto& n : names) {
    std::ifstream in(from + "/" + n, std::ios::binary);
    std::ofstream(to + "/" + n, std::ios::binary) << in.rdbuf();
  }
}

inline void edit_manifest(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  const std::string path = dir + "/" + checkpoint::kManifest;
  nlohmann::json j = nlohmann::json::parse(std::ifstream(path));
  edit(j);
  // Sealed again (its checksum over the new text): the edit stands for a writer's mistake that the
  // reader must catch by what the manifest says, not for corruption.
  j.erase("manifest_crc32c");
  std::string text = j.dump(1);
  text.erase(text.size() - 2);  // the closing "\n}"
  std::ofstream(path) << checkpoint::detail::seal_manifest(text);
}

/// Runs the shell `command` with its output into a log in the test's shared directory: the exit
/// status and the output.
inline std::pair<int, std::string> run_logged(const std::string& command) {
  const std::string log = shared_dir() + "/command.log";
  const int rc = std::system((command + " > " + log + " 2>&1").c_str());
  std::ifstream in(log);
  return {rc, std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>())};
}

#ifdef FSDP_PYTHON
/// Python reads what C++ wrote (tests/checkpoint/check_consolidated_in_python.py): the consolidated `single`
/// file and `sharded` files (with the optimizer), and `checkpoint` itself through
/// tools/read_checkpoint.py, each equal to `full` bit for bit.
inline void expect_python_reads(const torch::OrderedDict<std::string, at::Tensor>& full, const std::string& checkpoint,
                                const std::string& single, const std::string& sharded) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& kv : full) tensors.emplace_back(kv.key(), kv.value());
  const std::string reference = shared_dir() + "/reference.safetensors";
  checkpoint::write_safetensors(reference, tensors);
  const auto [rc, text] =
      run_logged(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR + "/tests/checkpoint/check_consolidated_in_python.py " +
                 reference + " " + checkpoint + " " + single + " " + sharded);
  EXPECT_EQ(rc, 0) << text;
  std::cout << text;
}
#endif

inline void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(offset));
  f.put(static_cast<char>(c ^ 0x10));
}

}  // namespace fsdp::testing
