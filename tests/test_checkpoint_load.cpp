// fsdp::checkpoint::load: checkpoints saved at 1-4 ranks, with every strategy and a mix, loaded at
// 1-4 ranks with the same strategy and with another one, and into a plain module: every tensor bit
// for bit, each rank reading the bytes of its own rows (with their checksum blocks), and the loaded
// model computing what a plain LibTorch model with the same weights computes. Then every fault:
// each its own error, on every rank, and the model left as it was.
#include "checkpoint/checkpoint.h"
#include "checkpoint/commit.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "optim/fused_adamw.h"
#include "tests/models.h"
#include "tests/temp_dir.h"

#include <c10/util/accumulate.h>
#include <torch/optim/rmsprop.h>
#include <torch/serialize.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>

namespace fsdp::testing {
namespace {

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

torch::OrderedDict<std::string, at::Tensor> state_of(const torch::nn::Module& m) {
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
std::vector<Case> saved_cases(int W) {
  return {{"full", ShardingStrategy::kFullShard, 0, false},
          {"grad_op", ShardingStrategy::kShardGradOp, 0, false},
          {"zero1", ShardingStrategy::kShardOptimizerState, 0, false},
          {"replicate", ShardingStrategy::kNoShard, 0, false},
          {"hybrid", ShardingStrategy::kHybridShard, W % 2 == 0 ? 2 : 1, false},
          {"mixed", ShardingStrategy::kFullShard, 0, true}};
}

std::shared_ptr<BufferedMLPImpl> build(const Case& c, Rank& r, uint64_t seed) {
  torch::manual_seed(seed);
  auto net = std::make_shared<BufferedMLPImpl>();
  if (c.mixed) net->fc1->set_sharding_strategy(ShardingStrategy::kNoShard);
  (void)r;
  return net;
}

FullyShardedModule<BufferedMLPImpl> wrap(const Case& c, Rank& r, uint64_t seed) {
  return fsdp::fully_shard(build(c, r, seed), r.pg, test_options(c.strategy, c.group));
}

std::string root_dir() {
  const char* d = std::getenv("FSDP_TEST_CKPT_ROOT");
  TORCH_CHECK(d != nullptr, "FSDP_TEST_CKPT_ROOT is not set");
  return d;
}

std::string ckpt_name(int N, const Case& c) {
  return "n" + std::to_string(N) + "-" + c.label;
}

// The same weights as the checkpoint in every dict entry, bit for bit.
void expect_bit_exact(const torch::OrderedDict<std::string, at::Tensor>& got,
                      const torch::OrderedDict<std::string, at::Tensor>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& kv : want) {
    const at::Tensor* g = got.find(kv.key());
    ASSERT_NE(g, nullptr) << what << ": " << kv.key();
    EXPECT_EQ(g->scalar_type(), kv.value().scalar_type()) << what << ": " << kv.key();
    EXPECT_TRUE(g->sizes() == kv.value().sizes() && g->equal(kv.value())) << what << ": " << kv.key();
  }
}

torch::OrderedDict<std::string, at::Tensor> read_reference(const std::string& path) {
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

int64_t rng_bytes() {
  return at::globalContext().defaultGenerator(at::Device(at::kCPU)).get_state().numel();
}

// The optimizers: SGD with momentum, AdamW and FusedAdamW (an AdamW: each loads the other's state).
enum class Opt { kSGD, kAdamW, kFused };
const char* opt_label(Opt o) {
  return o == Opt::kSGD ? "sgd" : o == Opt::kAdamW ? "adamw" : "fused";
}
Opt opt_of(int N, size_t i) {  // rotating with the world size, so that each case meets each optimizer
  return static_cast<Opt>((i + static_cast<size_t>(N)) % 3);
}
std::unique_ptr<torch::optim::Optimizer> make_opt(Opt o, const FSDPModule& model) {
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

// Every tensor of a checkpoint, whole, read chunk by chunk.
std::map<std::string, at::Tensor> read_all(const std::string& dir) {
  const auto m = checkpoint::read_manifest(dir);
  std::map<std::string, at::Tensor> out;
  for (const auto& t : m.tensors) {
    at::Tensor full = at::empty(t.shape, at::TensorOptions().dtype(checkpoint::scalar_type_of(t.dtype, t.key)));
    const uint64_t row_bytes = t.rows() > 0 ? t.bytes() / t.rows() : 0;
    for (const auto& c : t.chunks) {
      checkpoint::read_bytes(dir + "/" + m.files[c.file].name, c.begin, c.end - c.begin,
                             static_cast<char*>(full.data_ptr()) + c.row_begin * row_bytes);
    }
    out[t.key] = full;
  }
  return out;
}

// At N ranks: each case trained one step with its optimizer (so that no weight or moment is its
// initial value), saved, its full weights written beside it by rank 0 as the reference, and then
// trained two more steps, whose losses are the reference for a load that continues training.
void save_all(Rank& r) {
  const std::string root = root_dir();
  const auto cases = saved_cases(r.world_size);
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const std::string name = ckpt_name(r.world_size, c);
    auto model = wrap(c, r, 7);
    auto opt = make_opt(opt_of(r.world_size, i), model);
    train_step(model, *opt, r, 0);
    const auto full = model.full_state_dict(/*rank0_only=*/true);
    const auto res = checkpoint::save(root, model, *opt, checkpoint::SaveOptions().name(name).step(1));
    if (r.rank == 0) {
      // Each unique byte once: the chunks add up to the model's and the moments' bytes, from shapes.
      const int64_t moments = opt_of(r.world_size, i) == Opt::kSGD ? 1 : 2;
      int64_t unique = 0;
      for (const auto& s : model.shard_specs()) {
        unique +=
            (1 + moments) * c10::multiply_integers(s.global_shape) * static_cast<int64_t>(c10::elementSize(s.dtype));
      }
      for (const auto& b : model.buffers()) unique += b.numel() * b.element_size();
      // Apart: each rank's CPU generator state (no CUDA here).
      EXPECT_EQ(res.bytes_total, unique + r.world_size * rng_bytes()) << name;
      const auto m = checkpoint::read_manifest(res.path);
      EXPECT_EQ(m.optimizer.steps.size(), moments == 2 ? model.shard_specs().size() : 0u) << name;
      for (const auto& kv : m.optimizer.steps) EXPECT_EQ(kv.second, 1) << name << ": " << kv.first;
    }
    const double l1 = train_step(model, *opt, r, 1), l2 = train_step(model, *opt, r, 2);
    if (r.rank == 0) {
      torch::serialize::OutputArchive out;
      for (const auto& kv : full) out.write(kv.key(), kv.value());
      out.write("loss1", torch::tensor(l1, torch::kDouble));
      out.write("loss2", torch::tensor(l2, torch::kDouble));
      out.save_to(root + "/" + name + ".ref");
    }
  }
}

// At M ranks: every checkpoint of every N, with its own strategy and with another (rotating), and
// AdamW's state into FusedAdamW and back on the second load.
void load_all(Rank& r) {
  const std::string root = root_dir();
  const int M = r.world_size;
  const auto load_cases = saved_cases(M);
  int64_t needed = 0, read = 0;
  for (int N = 1; N <= 4; ++N) {
    const auto saved = saved_cases(N);
    for (size_t i = 0; i < saved.size(); ++i) {
      const std::string name = ckpt_name(N, saved[i]);
      auto want = read_reference(root + "/" + name + ".ref");
      const double loss1 = want["loss1"].item<double>(), loss2 = want["loss2"].item<double>();
      want.erase("loss1");
      want.erase("loss2");
      for (int second = 0; second < 2; ++second) {
        const Case& c = load_cases[second ? (i + 1 + N) % load_cases.size() : i];
        Opt o = opt_of(N, i);
        if (second && o != Opt::kSGD) o = o == Opt::kAdamW ? Opt::kFused : Opt::kAdamW;
        const std::string what =
            name + " loaded at " + std::to_string(M) + " ranks as " + c.label + " with " + opt_label(o);
        SCOPED_TRACE(what);
        auto model = wrap(c, r, 1234);  // other weights before the load
        auto opt = make_opt(o, model);
        const auto res = checkpoint::load(root + "/" + name, model, *opt);
        EXPECT_EQ(res.saved_world_size, N);
        EXPECT_EQ(res.step, 1);
        // Needed: the rows this rank holds of each parameter and of each of its moments, from shapes.
        int64_t mine = 0;
        const int64_t moments = o == Opt::kSGD ? 1 : 2;
        for (const auto& s : model.shard_specs()) mine += (1 + moments) * s.local.numel() * s.local.element_size();
        for (const auto& b : model.buffers()) mine += b.numel() * b.element_size();
        if (r.rank < N) mine += rng_bytes();  // its own generator's state
        EXPECT_EQ(res.bytes_needed, mine);
        EXPECT_EQ(res.rng, r.rank < N ? "restored" : "derived");
        EXPECT_GE(res.bytes_read, res.bytes_needed);
        EXPECT_LE(res.files_opened, N);
        needed += res.bytes_needed;
        read += res.bytes_read;
        expect_bit_exact(model.full_state_dict(), want, what);
        if (::testing::Test::HasFailure()) return;

        if (!second) {
          // Saved again at M right away: every tensor (the moments too) and the optimizer's record
          // equal the original's bit for bit.
          const std::string again = name + "-at" + std::to_string(M);
          checkpoint::save(root, model, *opt, checkpoint::SaveOptions().name(again).step(1));
          if (r.rank == 0) {
            auto a = read_all(root + "/" + name), b = read_all(root + "/" + again);
            for (auto* all : {&a, &b}) {  // each rank's generators: as many as ranks saved
              for (auto it = all->begin(); it != all->end();)
                it = it->first.rfind("rng/", 0) == 0 ? all->erase(it) : ++it;
            }
            ASSERT_EQ(a.size(), b.size());
            for (const auto& [key, t] : a) {
              ASSERT_EQ(b.count(key), 1u) << key;
              EXPECT_TRUE(t.equal(b.at(key))) << what << ": " << key;
            }
            const auto ma = checkpoint::read_manifest(root + "/" + name),
                       mb = checkpoint::read_manifest(root + "/" + again);
            EXPECT_EQ(ma.optimizer.steps, mb.optimizer.steps);
            ASSERT_EQ(ma.optimizer.param_groups.size(), mb.optimizer.param_groups.size());
            EXPECT_EQ(ma.optimizer.param_groups[0].options, mb.optimizer.param_groups[0].options);
            EXPECT_EQ(ma.optimizer.param_groups[0].params, mb.optimizer.param_groups[0].params);
          }
        }

        // It computes what a plain model loaded from the same checkpoint computes (ZeRO-1's full
        // parameters were gathered again from the loaded rows) ...
        torch::manual_seed(4321);
        auto plain = std::make_shared<PlainMLPImpl>();
        checkpoint::load(root + "/" + name, *plain);
        expect_bit_exact(state_of(*plain), want, what + ", plain");
        torch::manual_seed(11);
        auto x = torch::randn({kGlobalBatch, 7});
        auto loss = model(local_rows(x, r.rank, M)).square().mean().detach() / M;
        all_reduce_sum(r, loss);
        EXPECT_NEAR(loss.item<double>(), plain->forward(x).square().mean().item<double>(), 1e-6);
        // ... and training goes on as it did at N ranks without the interruption.
        const double l1 = train_step(model, *opt, r, 1), l2 = train_step(model, *opt, r, 2);
        EXPECT_NEAR(l1, loss1, 1e-5 * std::abs(loss1)) << what;
        EXPECT_NEAR(l2, loss2, 1e-5 * std::abs(loss2)) << what;
      }
    }
  }
  if (r.rank == 0) std::cout << "loads at " << M << " ranks: read/needed " << double(read) / needed << std::endl;
}

TEST(CheckpointLoad, ReshardMatrixEveryStrategyBitExact) {
  std::unique_ptr<TempDir> tmp;  // in the test process only; the ranks take its path from the environment
  RunOptions o;
  o.timeout = std::chrono::seconds(300);
  if (!in_rank_process()) {
    tmp = std::make_unique<TempDir>();
    o.env["FSDP_TEST_CKPT_ROOT"] = tmp->path;
  }
  for (int N = 1; N <= 4; ++N) run_ranks(N, save_all, o);
  for (int M = 1; M <= 4; ++M) run_ranks(M, load_all, o);
}

// Copies checkpoint `from` to `to` (its files only), byte for byte.
void copy_checkpoint(const std::string& from, const std::string& to) {
  TORCH_CHECK(::mkdir(to.c_str(), 0755) == 0, "mkdir ", to);
  const auto m = checkpoint::read_manifest(from);
  std::vector<std::string> names{checkpoint::kManifest};
  for (const auto& f : m.files) names.push_back(f.name);
  for (const auto& n : names) {
    std::ifstream in(from + "/" + n, std::ios::binary);
    std::ofstream(to + "/" + n, std::ios::binary) << in.rdbuf();
  }
}

void edit_manifest(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  const std::string path = dir + "/" + checkpoint::kManifest;
  nlohmann::json j = nlohmann::json::parse(std::ifstream(path));
  edit(j);
  std::ofstream(path) << j.dump(1);
}

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(offset));
  f.put(static_cast<char>(c ^ 0x10));
}

struct Fault {
  const char* name;
  std::function<void(const std::string& dir)> make;  // on rank 0, on a copy of the good checkpoint
  // Said by the ranks that find it (the others say it failed on another rank).
  std::string message;
  std::vector<int> found_by;
};

// At 2 ranks: a good checkpoint, then each fault on a copy of it. Every rank's load throws (the
// rank that finds the fault says what, file and tensor; the other says it failed elsewhere) and
// leaves the model bit for bit as it was.
void check_faults(Rank& r) {
  const std::string root = shared_dir() + "/ckpts";
  const Case full{"full", ShardingStrategy::kFullShard, 0, false};
  auto saved = wrap(full, r, 7);
  auto sgd = make_opt(Opt::kSGD, saved);
  train_step(saved, *sgd, r, 0);
  checkpoint::save(root, saved, *sgd, checkpoint::SaveOptions().name("good").step(3));
  checkpoint::save(root, saved, checkpoint::SaveOptions().name("model-only").step(3));
  const std::string good = root + "/good";
  const auto m = checkpoint::read_manifest(good);
  const checkpoint::ManifestTensor* fc1 = nullptr;
  for (const auto& t : m.tensors) {
    if (t.key == "model/fc1.weight") fc1 = &t;
  }
  ASSERT_NE(fc1, nullptr);
  ASSERT_EQ(fc1->chunks.size(), 2u);  // rows 0-6 by rank 0, 7-12 by rank 1: each rank reads its own
  const uint64_t in_rank1s_rows = fc1->chunks[1].begin + 5;
#ifdef FSDP_PYTHON
  {
    // Each rank's file opens with Python's safetensors; what Python loaded (written back by it and
    // read here) equals this rank's C++ shards, bit for bit.
    char file[64];
    std::snprintf(file, sizeof(file), "/rank-%05d.safetensors", r.rank);
    const std::string back = shared_dir() + "/python-" + std::to_string(r.rank) + ".safetensors";
    const std::string cmd = std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                            "/tests/check_safetensors_in_python.py " + good + file + " " + back + " > " + back +
                            ".log 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    const auto rec = checkpoint::read_safetensors_header(back);
    int compared = 0;
    for (const auto& s : saved.shard_specs()) {
      for (const auto& t : rec.tensors) {
        const std::string prefix = "model/" + s.name + "[";
        if (t.name.rfind(prefix, 0) != 0) continue;
        const int64_t b = std::stoll(t.name.substr(prefix.size())), e = std::stoll(t.name.substr(t.name.find(':') + 1));
        const at::Tensor rows = s.local.dim() == 0 ? s.local : s.local.narrow(0, b - s.row_begin, e - b);
        EXPECT_TRUE(checkpoint::read_tensor(back, t).equal(rows.detach())) << t.name;
        ++compared;
      }
    }
    EXPECT_GT(compared, 2) << "rank " << r.rank << " wrote rows of several parameters";
  }
#endif
  auto barrier = [&] {
    auto t = torch::zeros({1});
    all_reduce_sum(r, t);
  };

  const std::vector<Fault> faults = {
      {"flipped",
       [&](const std::string& d) { flip_byte(d + "/rank-00001.safetensors", in_rank1s_rows); },
       "tensor 'model/fc1.weight' rows 7 to 13 in '",
       {1}},
      {"truncated",
       [&](const std::string& d) { ::truncate((d + "/rank-00000.safetensors").c_str(), m.files[0].bytes - 100); },
       "/rank-00000.safetensors' has " + std::to_string(m.files[0].bytes - 100) + " bytes but the manifest says " +
           std::to_string(m.files[0].bytes) + ": it was truncated or replaced",
       {0, 1}},
      {"deleted",
       [&](const std::string& d) { ::unlink((d + "/rank-00001.safetensors").c_str()); },
       "/rank-00001.safetensors' (No such file or directory), which holds rows",
       {0, 1}},  // rank 0 reads a buffer's rows from it
      {"renamed",
       [&](const std::string& d) {
         edit_manifest(d, [](nlohmann::json& j) {
           j["tensors"]["model/fc2.biass"] = j["tensors"]["model/fc2.bias"];
           j["tensors"].erase("model/fc2.bias");
         });
       },
       "In the model, not in the checkpoint (1): model/fc2.bias (parameter, F32 [5]). In the checkpoint, not in the "
       "model (1): model/fc2.biass.",
       {0, 1}},
      {"newer",
       [&](const std::string& d) { edit_manifest(d, [](nlohmann::json& j) { j["format_version"] = 2; }); },
       "has format version 2, newer than this library's (1)",
       {0, 1}},
      {"no manifest",
       [&](const std::string& d) { ::unlink((d + "/" + checkpoint::kManifest).c_str()); },
       "is neither a checkpoint (no manifest.json) nor a root with a 'latest' pointer",
       {0, 1}},
  };
  for (const Fault& f : faults) {
    SCOPED_TRACE(f.name);
    const std::string dir = root + "/fault-" + std::to_string(&f - faults.data());
    if (r.rank == 0) {
      copy_checkpoint(good, dir);
      f.make(dir);
    }
    barrier();
    auto model = wrap(full, r, 1234);
    const auto before = model.full_state_dict();
    const std::string msg = error_of([&] { checkpoint::load(dir, model); });
    std::cout << f.name << ": " << msg << std::endl;  // shown with FSDP_TEST_SHOW_OUTPUT=1
    const bool finds = std::find(f.found_by.begin(), f.found_by.end(), r.rank) != f.found_by.end();
    EXPECT_NE(msg.find("fsdp::checkpoint::load (rank " + std::to_string(r.rank) + " of 2) of '" + dir + "': "),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find(finds ? f.message : "failed on another rank (its error says why); the model was left as it was"),
              std::string::npos)
        << msg;
    expect_bit_exact(model.full_state_dict(), before, std::string(f.name) + ": the model is untouched");
  }

  // A model of another dtype, and one without the buffers (strict: refused; not strict: loaded).
  {
    torch::manual_seed(1);
    auto net = std::make_shared<BufferedMLPImpl>();
    net->to(torch::kDouble);
    auto model = fsdp::fully_shard(net, r.pg, test_options());
    const std::string msg = error_of([&] { checkpoint::load(good, model); });
    EXPECT_NE(msg.find("Different (9): model/scale: parameter F32 [] in the checkpoint, parameter F64 [] in the "
                       "model; model/head.weight: parameter F32 [3, 5] in the checkpoint, parameter F64 [3, 5]"),
              std::string::npos)
        << msg;
  }
  {
    torch::manual_seed(1);
    auto model = fsdp::fully_shard(std::make_shared<UnevenMLPImpl<true>>(), r.pg, test_options());
    const std::string msg = error_of([&] { checkpoint::load(good, model); });
    EXPECT_NE(msg.find("In the checkpoint, not in the model (2): model/count; model/running. Load it into the model "
                       "it was saved from (same architecture, names and dtypes), or pass LoadOptions().strict(false)"),
              std::string::npos)
        << msg;
    checkpoint::load(good, model, checkpoint::LoadOptions().strict(false));
    auto want = saved.full_state_dict();
    want.erase("running");
    want.erase("count");
    expect_bit_exact(model.full_state_dict(), want, "not strict");
  }
  // The optimizer: another type, another param group, none saved; an optimizer the format does
  // not support is refused by the save on every rank.
  {
    auto model = wrap(full, r, 1234);
    const auto before = model.full_state_dict();
    auto adamw = make_opt(Opt::kAdamW, model);
    std::string msg = error_of([&] { checkpoint::load(good, model, *adamw); });
    EXPECT_NE(
        msg.find("holds SGD state, but the optimizer is AdamW: load it into the optimizer type it was saved from"),
        std::string::npos)
        << msg;
    msg = error_of([&] { checkpoint::load(root + "/model-only", model, *adamw); });
    EXPECT_NE(msg.find("was saved without an optimizer: load the model alone"), std::string::npos) << msg;
    auto params = model->parameters();
    params.pop_back();
    torch::optim::SGD fewer(params, torch::optim::SGDOptions(0.5).momentum(0.9));
    msg = error_of([&] { checkpoint::load(good, model, fewer); });
    EXPECT_NE(msg.find("param group 0 of the optimizer does not hold the parameters it was saved with (6 now, 7 "
                       "saved; saved, not in the group: "),
              std::string::npos)
        << msg;
    EXPECT_EQ(fewer.param_groups()[0].options().get_lr(), 0.5);  // untouched
    EXPECT_TRUE(fewer.state().empty());
    expect_bit_exact(model.full_state_dict(), before, "optimizer faults: the model is untouched");
    // A load between a forward and its backward is refused (the backward would find its weights
    // changed), and the backward then runs.
    {
      torch::manual_seed(3);
      auto loss = model(torch::randn({kGlobalBatch / 2, 7})).square().mean();
      msg = error_of([&] { checkpoint::load(good, model); });
      EXPECT_NE(msg.find("a step is under way (a forward ran with gradients and its backward has not"),
                std::string::npos)
          << msg;
      loss.backward();
      model->zero_grad();
    }
    // Another model with its optimizer: the model's difference is what is reported.
    {
      auto other = fsdp::fully_shard(std::make_shared<UnevenMLPImpl<true>>(), r.pg, test_options());
      auto other_sgd = make_opt(Opt::kSGD, other);
      msg = error_of([&] { checkpoint::load(good, other, *other_sgd); });
      EXPECT_NE(msg.find("does not fit the model; nothing was loaded. In the checkpoint, not in the model (2)"),
                std::string::npos)
          << msg;
    }
    // Edited optimizer steps and world size: refused, each with its reason.
    {
      auto adamw_model = wrap(full, r, 5);
      auto adam = make_opt(Opt::kAdamW, adamw_model);
      train_step(adamw_model, *adam, r, 0);
      checkpoint::save(root, adamw_model, *adam, checkpoint::SaveOptions().name("adamw"));
      const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> edits = {
          {[](nlohmann::json& j) { j["optimizer"]["steps"].erase("scale"); },
           "holds AdamW state of parameter 'scale' but no step for it"},
          {[](nlohmann::json& j) { j["optimizer"]["steps"]["scale"] = -5; },
           "gives parameter 'scale' the optimizer step -5, not a whole number from 0"},
          {[](nlohmann::json& j) { j["optimizer"]["steps"]["scale"] = 2.5; },
           "gives parameter 'scale' the optimizer step 2.5, not a whole number from 0"},
          {[](nlohmann::json& j) { j["world_size"] = 7; }, "says 7 ranks saved it but lists 2 files"}};
      for (size_t e = 0; e < edits.size(); ++e) {
        const std::string dir = root + "/edited-" + std::to_string(e);
        if (r.rank == 0) {
          copy_checkpoint(root + "/adamw", dir);
          edit_manifest(dir, edits[e].first);
        }
        barrier();
        auto target = wrap(full, r, 1234);
        auto target_opt = make_opt(Opt::kAdamW, target);
        const auto before_edit = target.full_state_dict();
        const std::string m2 = error_of([&] { checkpoint::load(dir, target, *target_opt); });
        EXPECT_NE(m2.find(edits[e].second), std::string::npos) << m2;
        EXPECT_TRUE(target_opt->state().empty());
        expect_bit_exact(target.full_state_dict(), before_edit, "edited optimizer: untouched");
      }
    }
    torch::optim::RMSprop rmsprop(model->parameters());
    msg = error_of([&] { checkpoint::save(root, model, rmsprop, checkpoint::SaveOptions().name("rmsprop")); });
    EXPECT_NE(msg.find("optimizer type torch::optim::RMSprop is not supported (torch::optim::SGD, Adam, AdamW and "
                       "fsdp::optim::FusedAdamW are)"),
              std::string::npos)
        << msg;
    EXPECT_EQ(checkpoint::latest_checkpoint(root), root + "/adamw");
    EXPECT_FALSE(::access((root + "/.staging-rmsprop").c_str(), F_OK) == 0) << "refused before the disk";
  }
  // The plain path: the same checks, and a flipped byte leaves the module as it was.
  if (r.rank == 0) {
    auto plain = std::make_shared<PlainMLPImpl>();
    torch::OrderedDict<std::string, at::Tensor> before;
    for (const auto& kv : state_of(*plain)) before.insert(kv.key(), kv.value().clone());
    const std::string msg = error_of([&] { checkpoint::load(root + "/fault-0", *plain); });
    EXPECT_NE(msg.find("' into a plain module: tensor 'model/fc1.weight' rows 7 to 13"), std::string::npos) << msg;
    expect_bit_exact(state_of(*plain), before, "plain: untouched");
    const std::string staging = error_of([&] { checkpoint::load(root + "/.staging-x", *plain); });
    EXPECT_NE(staging.find("is a staging directory of a save that did not finish: it is never loaded"),
              std::string::npos)
        << staging;
  }
  barrier();
  if (r.rank == 0) remove_tree(root);
}

TEST(CheckpointLoad, EachFaultItsOwnErrorOnEveryRankAndTheModelUntouched) {
  run_ranks(2, check_faults);
}

// Generator states: saved at 2 ranks, loaded at 3. Ranks 0 and 1 draw what they drew after the
// save; rank 2, new, derives its own: the same on every such load, unlike the others'.
std::vector<float> draw() {
  const auto t = torch::rand({4});
  return {t.data_ptr<float>(), t.data_ptr<float>() + 4};
}
void save_rng(Rank& r) {
  const Case full{"full", ShardingStrategy::kFullShard, 0, false};
  auto model = wrap(full, r, 7);
  torch::manual_seed(50 + r.rank);
  draw();
  checkpoint::save(root_dir(), model, checkpoint::SaveOptions().name("rng"));
  torch::save(torch::tensor(draw()), root_dir() + "/draw-" + std::to_string(r.rank) + ".pt");
}
void load_rng(Rank& r) {
  const Case full{"full", ShardingStrategy::kFullShard, 0, false};
  auto model = wrap(full, r, 1234);
  std::vector<std::vector<float>> draws;
  for (uint64_t seed : {999, 12345}) {
    torch::manual_seed(seed + r.rank);
    const auto res = checkpoint::load(root_dir() + "/rng", model);
    EXPECT_EQ(res.rng, r.rank < 2 ? "restored" : "derived");
    draws.push_back(draw());
  }
  EXPECT_EQ(draws[0], draws[1]) << "the same load draws the same numbers";
  if (r.rank < 2) {
    at::Tensor saved;
    torch::load(saved, root_dir() + "/draw-" + std::to_string(r.rank) + ".pt");
    EXPECT_EQ(draws[0], std::vector<float>(saved.data_ptr<float>(), saved.data_ptr<float>() + 4));
  }
  // Every rank's draws differ from every other's.
  auto mine = torch::tensor(draws[0]);
  auto gathered = torch::zeros({3, 4});
  gathered[r.rank] = mine;
  all_reduce_sum(r, gathered);
  for (int a = 0; a < 3; ++a) {
    for (int b = a + 1; b < 3; ++b) EXPECT_FALSE(gathered[a].equal(gathered[b])) << a << " and " << b;
  }
  // Not restored when not asked for, nor from a checkpoint saved without them.
  torch::manual_seed(77);
  const auto before = draw();
  torch::manual_seed(77);
  EXPECT_EQ(checkpoint::load(root_dir() + "/rng", model, checkpoint::LoadOptions().rng_states(false)).rng,
            "not loaded");
  EXPECT_EQ(draw(), before);
}

TEST(CheckpointLoad, GeneratorStatesRestoredAndDerivedForNewRanks) {
  std::unique_ptr<TempDir> tmp;
  RunOptions o;
  if (!in_rank_process()) {
    tmp = std::make_unique<TempDir>();
    o.env["FSDP_TEST_CKPT_ROOT"] = tmp->path;
  }
  run_ranks(2, save_rng, o);
  run_ranks(3, load_rng, o);
}

}  // namespace
}  // namespace fsdp::testing
