// ckpt_bench: sharded checkpoints against plain large writes and reads of the same bytes, and the
// manifest's cost at many simulated ranks (docs/benchmarks.md, "Checkpoints").
//
//   torchrun --no-python --nproc-per-node 4 build/benchmarks/ckpt_bench save --dir D
//   torchrun --no-python --nproc-per-node 3 build/benchmarks/ckpt_bench load --dir D
//   build/benchmarks/ckpt_bench simulate --ranks 128,256,512,1024
//
// save: a GPT with AdamW (one step taken, so the moments exist) saved to D, alternating with each
// rank writing the same number of bytes to its own file in 8 MiB write() calls and fsyncing it; the
// time of each, barrier to barrier, and their ratio; each rank's bytes (max/mean).
// load: the checkpoint loaded on this many ranks, alternating with each rank reading as many bytes
// as the load read from the raw files in 8 MiB read() calls; before each, every file under D is
// dropped from the page cache (posix_fadvise DONTNEED), so both read the disk. Bytes read over
// bytes needed over all ranks.
// simulate: rank 0's assembly of the manifest from the parts of N ranks of a fully sharded GPT
// with AdamW (parts built from shapes, the save plan and the checksum blocks, as the ranks would
// send them), and a reader's read_manifest of the result.
#include <torch/nn/functional/loss.h>
#include "benchmarks/bench_launch.h"
#include "checkpoint/async_save.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/commit.h"
#include "checkpoint/internal/manifest_builder.h"
#include "checkpoint/internal/parallel_io.h"
#include "checkpoint/manifest.h"
#include "checkpoint/plan.h"
#include "checkpoint/safetensors.h"
#include "examples/gpt.h"
#include "examples/strategy_flags.h"
#include "fsdp/fsdp.h"

#include <torch/optim/adamw.h>

#include <nlohmann/json.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kIo = size_t{8} << 20;

struct Flags {
  std::string mode, dir;
  std::string strategy = "full";  // full | grad-op | optimizer | replicate | hybrid (groups of 2)
  gpt::Config model;
  int reps = 6;
  int async_reps = 20;
  int io_threads = 1;
  bool direct = false;
  bool json = false;
  std::vector<int> worlds{1, 2, 4};
  std::vector<int> ranks{128, 256, 512, 1024};
};

Flags parse(int argc, char** argv) {
  Flags f;
  f.model.n_layer = 8;
  f.model.n_embd = 512;
  f.model.n_head = 8;
  TORCH_CHECK(argc >= 2,
              "usage: ckpt_bench compare [--json] [--world-sizes 1,2,4] [--dir D] [--reps 3] [--async-reps 20] "
              "[--io-threads T] | save|load|async --dir D [--direct] [--io-threads T] | simulate [--ranks 128,1024] "
              "[--n-layer L --n-embd C --n-head H]");
  f.mode = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--json" || k == "--direct") {
      (k == "--json" ? f.json : f.direct) = true;
      continue;
    }
    TORCH_CHECK(i + 1 < argc, "ckpt_bench: ", k, " needs a value");
    const std::string v = argv[++i];
    if (k == "--dir") {
      f.dir = v;
    } else if (k == "--n-layer") {
      f.model.n_layer = std::stoll(v);
    } else if (k == "--n-head") {
      f.model.n_head = std::stoll(v);
    } else if (k == "--n-embd") {
      f.model.n_embd = std::stoll(v);
    } else if (k == "--strategy") {
      TORCH_CHECK(gpt::strategy_flags().count(v) == 1, "ckpt_bench: unknown --strategy ", v);
      f.strategy = v;
    } else if (k == "--async-reps") {
      f.async_reps = std::stoi(v);
    } else if (k == "--io-threads") {
      f.io_threads = std::stoi(v);
    } else if (k == "--world-sizes") {
      f.worlds.clear();
      std::stringstream ss(v);
      for (std::string x; std::getline(ss, x, ',');) f.worlds.push_back(std::stoi(x));
    } else if (k == "--reps") {
      f.reps = std::stoi(v);
    } else if (k == "--ranks") {
      f.ranks.clear();
      std::stringstream ss(v);
      for (std::string x; std::getline(ss, x, ',');) f.ranks.push_back(std::stoi(x));
    } else {
      TORCH_CHECK(false, "ckpt_bench: unknown flag ", k);
    }
  }
  return f;
}

void barrier(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  auto t = torch::zeros({1});
  fsdp::all_reduce(pg, t);
}

double max_over_ranks(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, double v) {
  auto t = torch::tensor({v}, torch::kDouble);
  fsdp::all_reduce(pg, t, c10d::ReduceOp::MAX);
  return t.item<double>();
}

// Seconds of `fn` on all ranks, barrier to barrier.
template <typename Fn>
double timed(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, Fn&& fn) {
  barrier(pg);
  const auto t0 = Clock::now();
  fn();
  barrier(pg);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::vector<std::string> files_under(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  while (dirent* e = d ? ::readdir(d) : nullptr) {
    const std::string n = e->d_name, p = dir + "/" + n;
    if (n == "." || n == "..") continue;
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      for (const auto& x : files_under(p)) out.push_back(x);
    } else {
      out.push_back(p);
    }
  }
  if (d) ::closedir(d);
  return out;
}

void drop_cache(const std::string& dir) {
  for (const auto& f : files_under(dir)) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

std::string raw_file(const std::string& dir, int rank) {
  return dir + "/raw/rank-" + std::to_string(rank) + ".bin";
}

// `src` (the bytes, in memory, as a save's tensors are) written to `path` by the checkpoint's own
// writer with the same threads, 8 MiB blocks and flags as the save (so raw and save differ by the
// library's work only), then fsynced.
void raw_write(const std::string& path, const std::vector<char>& src, const Flags& f) {
  fsdp::checkpoint::detail::IoOptions io;
  io.threads = f.io_threads;
  io.direct = f.direct;
  fsdp::checkpoint::detail::write_pieces(path, {{src.data(), src.size()}}, io);
  fsdp::checkpoint::fsync_path(path);
}

// `bytes` from the raw files, taken as one stream, from `offset` on, into `dst` (memory that holds
// them all, as a load's does), in 8 MiB preads on the load's number of threads.
void raw_read(const std::string& dir, int files, int64_t offset, int64_t bytes, std::vector<char>& dst, int threads) {
  std::vector<std::string> paths;
  std::vector<int> fds;
  std::vector<fsdp::checkpoint::detail::ReadRequest> requests;
  paths.reserve(static_cast<size_t>(files));
  char* out = dst.data();
  for (int f = 0; f < files && bytes > 0; ++f) {
    paths.push_back(raw_file(dir, f));
    struct stat st {};
    TORCH_CHECK(::stat(paths.back().c_str(), &st) == 0, "no ", paths.back(), ": run ckpt_bench save first");
    if (offset >= st.st_size) {
      offset -= st.st_size;
      continue;
    }
    fds.push_back(::open(paths.back().c_str(), O_RDONLY | O_CLOEXEC));
    const int64_t n = std::min<int64_t>(bytes, st.st_size - offset);
    requests.push_back({fds.back(), &paths.back(), static_cast<uint64_t>(offset), static_cast<uint64_t>(n), out});
    out += n;
    bytes -= n;
    offset = 0;
  }
  fsdp::checkpoint::detail::read_parallel(requests, threads, kIo);
  for (int fd : fds) ::close(fd);
}

struct Job {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  int rank = 0, world = 1;
};

auto build(const Flags& f, const Job& j, uint64_t seed) {
  torch::manual_seed(seed);
  auto model = fsdp::fully_shard(
      gpt::make_gpt<true>(f.model), j.pg,
      fsdp::FullyShardOptions().strategy(gpt::strategy_flags().at(f.strategy)).shard_group_size(std::min(2, j.world)));
  auto opt = std::make_unique<torch::optim::AdamW>(model.parameters(), torch::optim::AdamWOptions(1e-3));
  auto x = torch::randint(256, {j.world, f.model.block_size}, torch::kLong);
  auto logits = model(x.narrow(0, j.rank, 1));
  torch::nn::functional::cross_entropy(logits.flatten(0, 1), x.narrow(0, j.rank, 1).flatten()).backward();
  opt->step();
  return std::make_pair(std::move(model), std::move(opt));
}

int save_mode(const Flags& f, const Job& j) {
  auto built = build(f, j, 1);
  auto& model = built.first;
  auto& opt = built.second;
  ::mkdir(f.dir.c_str(), 0755);
  ::mkdir((f.dir + "/raw").c_str(), 0755);
  int64_t mine = 0;  // this rank's bytes in the last save (the first save runs before any raw write)
  for (int rep = 0; rep < f.reps; ++rep) {
    fsdp::checkpoint::SaveResult res;
    double save_s = 0, raw_s = 0;
    auto save = [&] {
      save_s = timed(j.pg, [&] {
        res = fsdp::checkpoint::save(f.dir, model, *opt,
                                     fsdp::checkpoint::SaveOptions()
                                         .name("rep-" + std::to_string(rep))
                                         .step(rep)
                                         .keep_last(1)
                                         .io_threads(f.io_threads)
                                         .direct_io(f.direct));
      });
      mine = res.bytes_written;
    };
    auto raw = [&] {
      const std::vector<char> src(static_cast<size_t>(mine), 'x');  // in memory (touched) before the clock
      raw_s = timed(j.pg, [&] { raw_write(raw_file(f.dir, j.rank), src, f); });
    };
    if (rep % 2 == 0) {
      save();
      raw();
    } else {
      raw();
      save();
    }
    auto per_rank = torch::zeros({j.world}, torch::kLong);
    per_rank[j.rank] = res.bytes_written;
    fsdp::all_reduce(j.pg, per_rank);
    if (j.rank == 0) {
      const double total = static_cast<double>(per_rank.sum().item<int64_t>());
      const double mx = static_cast<double>(per_rank.max().item<int64_t>());
      std::printf(
          "{\"mode\": \"save\", \"rep\": %d, \"ranks\": %d, \"strategy\": \"%s\", \"io_threads\": %d, "
          "\"direct\": %s, \"order\": \"%s\", "
          "\"bytes_total\": %lld, "
          "\"save_s\": %.4f, \"raw_write_s\": %.4f, \"save_over_raw\": %.3f, \"save_MBps\": %.1f, "
          "\"raw_MBps\": %.1f, \"per_rank_bytes_max_over_mean\": %.4f, \"per_rank_bytes\": %s}\n",
          rep, j.world, f.strategy.c_str(), f.io_threads, f.direct ? "true" : "false",
          rep % 2 == 0 ? "save first" : "raw first", static_cast<long long>(res.bytes_total), save_s, raw_s,
          save_s / raw_s, total / save_s / 1e6, total / raw_s / 1e6, mx / (total / j.world),
          [&] {
            std::ostringstream os;
            for (int r = 0; r < j.world; ++r) os << (r ? "/" : "") << per_rank[r].item<int64_t>();
            return "\"" + os.str() + "\"";
          }()
              .c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

int load_mode(const Flags& f, const Job& j) {
  auto built = build(f, j, 2);
  auto& model = built.first;
  auto& opt = built.second;
  int saved_ranks = 0;
  while (::access(raw_file(f.dir, saved_ranks).c_str(), F_OK) == 0) ++saved_ranks;
  const std::string ckpt = fsdp::checkpoint::latest_checkpoint(f.dir);
  TORCH_CHECK(!ckpt.empty(), "no checkpoint under ", f.dir, ": run ckpt_bench save first");
  fsdp::checkpoint::LoadResult res;  // the last load's (the first tells the raw read its bytes)
  for (int rep = 0; rep < f.reps; ++rep) {
    double load_s = 0, raw_s = 0;
    auto load = [&] {
      if (j.rank == 0) drop_cache(f.dir);
      load_s = timed(j.pg, [&] {
        res = fsdp::checkpoint::load(ckpt, model, *opt, fsdp::checkpoint::LoadOptions().io_threads(f.io_threads));
      });
    };
    auto raw = [&] {
      if (j.rank == 0) drop_cache(f.dir);
      auto mine = torch::zeros({j.world}, torch::kLong);
      mine[j.rank] = res.bytes_read;
      fsdp::all_reduce(j.pg, mine);
      const int64_t offset = j.rank == 0 ? 0 : mine.narrow(0, 0, j.rank).sum().item<int64_t>();
      std::vector<char> dst(static_cast<size_t>(res.bytes_read), 0);  // touched before the clock
      raw_s = timed(j.pg, [&] { raw_read(f.dir, saved_ranks, offset, res.bytes_read, dst, f.io_threads); });
    };
    if (rep % 2 == 0) {  // the first load tells how many bytes the raw read is to match
      load();
      raw();
    } else {
      raw();
      load();
    }
    if (j.rank == 0) {
      std::printf(
          "{\"mode\": \"load\", \"rep\": %d, \"ranks\": %d, \"saved_by\": %d, \"io_threads\": %d, "
          "\"order\": \"%s\", "
          "\"bytes_needed_total\": %lld, \"bytes_read_total\": %lld, \"read_over_needed\": %.4f, "
          "\"manifest_bytes\": %lld, \"preads_rank0\": %lld, \"files_rank0\": %lld, \"load_s\": %.4f, "
          "\"raw_read_s\": %.4f, \"load_over_raw\": %.3f, \"load_MBps\": %.1f, \"raw_MBps\": %.1f}\n",
          rep, j.world, res.saved_world_size, f.io_threads, rep % 2 == 0 ? "load first" : "raw first",
          static_cast<long long>(res.bytes_needed_total), static_cast<long long>(res.bytes_read_total),
          static_cast<double>(res.bytes_read_total) / static_cast<double>(res.bytes_needed_total),
          static_cast<long long>(res.manifest_bytes), static_cast<long long>(res.preads),
          static_cast<long long>(res.files_opened), load_s, raw_s, load_s / raw_s,
          static_cast<double>(res.bytes_read_total) / load_s / 1e6,
          static_cast<double>(res.bytes_read_total) / raw_s / 1e6);
      std::fflush(stdout);
    }
  }
  return 0;
}

int64_t status_bytes(const char* field) {  // VmRSS, VmHWM of this process
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(std::strlen(field) + 1)) * 1024;
  }
  return 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::string list(const std::vector<double>& v, const char* fmt = "%.4f") {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), fmt, v[i]);
    out += (i ? ", " : "") + std::string(buf);
  }
  return out + "]";
}

// async: the training stall of AsyncSaver::save (the call's time, max over ranks) against a
// synchronous save of the same state and against a plain memcpy of this rank's bytes (the floor
// on CPU); training steps run while the background write goes on (every rank steps until no rank's
// save is still writing), their time against steps with no save in flight; RSS after each save
// and the peak (VmHWM) over all of them.
int async_mode(const Flags& f, const Job& j) {
  auto built = build(f, j, 3);
  auto& model = built.first;
  auto& opt = built.second;
  ::mkdir(f.dir.c_str(), 0755);
  auto step = [&] {
    auto x = torch::randint(256, {1, f.model.block_size}, torch::kLong);
    auto logits = model(x);
    torch::nn::functional::cross_entropy(logits.flatten(0, 1), x.flatten()).backward();
    opt->step();
    opt->zero_grad();
  };
  std::vector<double> plain, sync;
  for (int i = 0; i < 3; ++i) plain.push_back(timed(j.pg, step));
  int64_t mine = 0;
  for (int i = 0; i < 2; ++i) {
    sync.push_back(timed(j.pg, [&] {
      mine = fsdp::checkpoint::save(f.dir, model, *opt,
                                    fsdp::checkpoint::SaveOptions().name("sync-" + std::to_string(i)).keep_last(1))
                 .bytes_written;
    }));
  }
  std::vector<char> from(static_cast<size_t>(mine), 'x'), to(static_cast<size_t>(mine), 'y');
  const auto c0 = Clock::now();
  std::memcpy(to.data(), from.data(), from.size());
  const double copy_s = max_over_ranks(j.pg, std::chrono::duration<double>(Clock::now() - c0).count());
  fsdp::checkpoint::AsyncSaver saver(model);
  std::vector<double> stalls, totals, during, rss;
  for (int rep = 0; rep < f.async_reps; ++rep) {
    barrier(j.pg);
    const auto t0 = Clock::now();
    const auto started = saver.save(
        f.dir, *opt, fsdp::checkpoint::SaveOptions().name("async-" + std::to_string(rep)).step(rep).keep_last(1));
    stalls.push_back(max_over_ranks(j.pg, started.seconds));
    for (;;) {
      auto busy = torch::full({1}, saver.writing() ? 1.0 : 0.0);
      fsdp::all_reduce(j.pg, busy, c10d::ReduceOp::MAX);
      if (busy.item<double>() == 0) break;
      const auto s0 = Clock::now();
      step();
      during.push_back(std::chrono::duration<double>(Clock::now() - s0).count());
    }
    saver.wait();
    totals.push_back(max_over_ranks(j.pg, std::chrono::duration<double>(Clock::now() - t0).count()));
    rss.push_back(static_cast<double>(status_bytes("VmRSS:")));
    if (j.rank == 0) std::cerr << "ckpt_bench async: save " << rep + 1 << " of " << f.async_reps << std::endl;
  }
  const double peak = max_over_ranks(j.pg, static_cast<double>(status_bytes("VmHWM:")));
  auto total_bytes = torch::tensor({mine}, torch::kLong);
  fsdp::all_reduce(j.pg, total_bytes);
  double during_mean = 0;
  for (double d : during) during_mean += d / static_cast<double>(during.size());
  if (j.rank == 0) {
    std::printf(
        "{\"mode\": \"async\", \"ranks\": %d, \"bytes_total\": %lld, \"sync_save_s\": %.4f, "
        "\"async_stall_s\": %s, \"async_stall_s_median\": %.4f, \"async_total_s_median\": %.4f, "
        "\"memcpy_s\": %.4f, \"stall_over_sync_save\": %.4f, \"stall_over_memcpy\": %.3f, \"step_s_plain\": %.4f, "
        "\"step_s_during_async\": %.4f, \"steps_during_async\": %zu, \"rss_after_each_async\": %s, "
        "\"host_peak_bytes\": %.0f, \"snapshot_bytes\": %lld}\n",
        j.world, static_cast<long long>(total_bytes.item<int64_t>()), median(sync), list(stalls).c_str(),
        median(stalls), median(totals), copy_s, median(stalls) / median(sync), median(stalls) / copy_s, median(plain),
        during_mean, during.size(), list(rss, "%.0f").c_str(), peak, static_cast<long long>(saver.snapshot_capacity()));
    std::fflush(stdout);
  }
  return 0;
}

// The parts N fully sharded ranks would send for `shapes` with AdamW's two moments, and each
// rank's generator state.
std::vector<std::string> simulated_parts(const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes,
                                         int N) {
  namespace ck = fsdp::checkpoint;
  std::vector<std::string> parts;
  for (int r = 0; r < N; ++r) {
    std::vector<fsdp::ShardSpec> specs;
    for (const auto& [name, shape] : shapes) {
      fsdp::ShardSpec s;
      s.name = name;
      s.global_shape = shape;
      s.layout = fsdp::row_layout(shape, N);
      s.shard_rank = r;
      s.shard_world_size = N;
      s.row_begin = s.layout.begin(r);
      s.row_end = s.layout.end(r);
      specs.push_back(s);
    }
    ck::detail::RankPart part;
    part.file = "rank-" + std::to_string(r) + ".safetensors";
    uint64_t at = 4096;
    auto chunk = [&](const std::string& key, int64_t b, int64_t e, uint64_t bytes) {
      const uint64_t block = ck::checksum_block(bytes, uint64_t{1} << 20, 64);
      std::vector<uint32_t> crcs((bytes + block - 1) / block, 0x9E3779B9u);
      part.chunks.push_back(
          {{"tensor", key}, {"rows", {b, e}}, {"bytes", {at, at + bytes}}, {"block_bytes", block}, {"crc32c", crcs}});
      at += bytes;
    };
    for (const auto& w : ck::plan_writes(specs)) {
      const auto& s = specs[w.spec];
      const auto bytes = static_cast<uint64_t>(w.bytes(s));
      chunk("model/" + s.name, w.row_begin, w.row_end, bytes);
      for (const char* m : {"exp_avg", "exp_avg_sq"}) {
        const std::string key = "optim/" + s.name + "/" + m;
        part.tensors[key] = {{"kind", "optimizer"}, {"dtype", "F32"}, {"shape", s.global_shape}};
        chunk(key, w.row_begin, w.row_end, bytes);
      }
    }
    for (const auto& s : specs) part.steps[s.name] = 1;
    const std::string rng = "rng/rank-" + std::to_string(r) + "/cpu";
    part.tensors[rng] = {{"kind", "rng"}, {"dtype", "U8"}, {"shape", {5056}}};
    chunk(rng, 0, 5056, 5056);
    part.file_bytes = at;
    parts.push_back(part.dump(r));
  }
  return parts;
}

int simulate_mode(const Flags& f) {
  namespace ck = fsdp::checkpoint;
  auto plain = gpt::make_gpt<false>(f.model);
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  ck::detail::ordered_json model_tensors = ck::detail::ordered_json::object();
  for (const auto& kv : plain->named_parameters()) {
    shapes.emplace_back(kv.key(), kv.value().sizes().vec());
    model_tensors["model/" + kv.key()] = {{"kind", "parameter"}, {"dtype", "F32"}, {"shape", kv.value().sizes().vec()}};
  }
  char tmpl[] = "/tmp/ckpt-bench-XXXXXX";
  TORCH_CHECK(::mkdtemp(tmpl) != nullptr, "mkdtemp failed");
  const std::string dir = tmpl;
  for (int N : f.ranks) {
    const auto parts = simulated_parts(shapes, N);
    size_t part_bytes = 0;
    for (const auto& p : parts) part_bytes += p.size();
    ck::detail::ManifestHeader h;
    h.name = "simulated";
    h.world_size = N;
    h.block_bytes = uint64_t{1} << 20;
    h.optimizer = {{"type", "AdamW"}, {"param_groups", ck::detail::ordered_json::array()}};
    int64_t total = 0;
    const auto t0 = Clock::now();
    const std::string text = ck::detail::assemble_manifest(h, model_tensors, parts, total);
    const double assemble_s = std::chrono::duration<double>(Clock::now() - t0).count();
    std::ofstream(dir + "/" + ck::kManifest) << text;
    const auto t1 = Clock::now();
    const auto m = ck::read_manifest(dir);
    const double read_s = std::chrono::duration<double>(Clock::now() - t1).count();
    size_t chunks = 0;
    for (const auto& t : m.tensors) chunks += t.chunks.size();
    std::printf(
        "{\"mode\": \"simulate\", \"ranks\": %d, \"params\": %zu, \"tensors\": %zu, \"chunks\": %zu, "
        "\"parts_bytes\": %zu, \"manifest_bytes\": %zu, \"assemble_s\": %.4f, \"read_manifest_s\": %.4f, "
        "\"assemble_us_per_chunk\": %.3f}\n",
        N, shapes.size(), m.tensors.size(), chunks, part_bytes, text.size(), assemble_s, read_s,
        assemble_s * 1e6 / static_cast<double>(chunks));
    std::fflush(stdout);
  }
  ::unlink((dir + "/" + ck::kManifest).c_str());
  ::rmdir(dir.c_str());
  return 0;
}

}  // namespace

// compare: every figure side by side in one run on one disk, for each world size: this library's
// save (buffered, and O_DIRECT) and load against the raw disk, its asynchronous save, and PyTorch
// DCP (benchmarks/dcp_bench.py, FSDP2, the same model and AdamW state) saving and loading the same
// state; then a resharding load (largest world size -> one rank fewer) of both. Progress on
// stderr (the runs' own), one table or JSON line per row on stdout.
using json = nlohmann::json;

std::vector<json> run_json(const std::string& cmd) {
  std::cerr << "ckpt_bench compare: " << cmd << std::endl;
  FILE* p = ::popen(cmd.c_str(), "r");
  TORCH_CHECK(p != nullptr, "ckpt_bench: cannot run ", cmd);
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  TORCH_CHECK(::pclose(p) == 0, "ckpt_bench: this run failed (its output is above): ", cmd);
  std::vector<json> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] == '{') lines.push_back(json::parse(line));
  }
  TORCH_CHECK(!lines.empty(), "ckpt_bench: no result from ", cmd);
  return lines;
}

double median_of(const std::vector<json>& lines, const char* key) {
  std::vector<double> v;
  for (const auto& l : lines) v.push_back(l.at(key).get<double>());
  return median(v);
}

int64_t bytes_under(const std::string& dir) {
  int64_t n = 0;
  for (const auto& f : files_under(dir)) {
    struct stat st {};
    if (::stat(f.c_str(), &st) == 0) n += st.st_size;
  }
  return n;
}

int compare_mode(const Flags& f) {
  const std::string python = FSDP_BENCH_PYTHON;
  TORCH_CHECK(!python.empty() && ::access(python.c_str(), X_OK) == 0, "ckpt_bench compare: no Python with torch at '",
              python, "' (configure with the virtualenv: scripts/build.sh)");
  const std::string torchrun = python.substr(0, python.rfind('/')) + "/torchrun";
  std::string dir = f.dir;
  if (dir.empty()) {
    char tmpl[] = "/tmp/ckpt-bench-XXXXXX";
    TORCH_CHECK(::mkdtemp(tmpl) != nullptr, "ckpt_bench: mkdtemp failed");
    dir = tmpl;
  }
  ::mkdir(dir.c_str(), 0755);
  const std::string model = " --n-layer " + std::to_string(f.model.n_layer) + " --n-embd " +
                            std::to_string(f.model.n_embd) + " --n-head " + std::to_string(f.model.n_head);
  auto ours = [&](int n, const std::string& args) {
    return run_json("OMP_NUM_THREADS=1 " + torchrun + " --standalone --nproc-per-node " + std::to_string(n) +
                    " --no-python " + bench::self_exe() + " " + args + model);
  };
  auto dcp = [&](int n, const std::string& args) {
    return run_json("OMP_NUM_THREADS=1 " + torchrun + " --standalone --nproc-per-node " + std::to_string(n) +
                    " --no-python " + python + " " + FSDP_BENCH_DCP_SCRIPT + " " + args + model)[0];
  };
  const std::string reps = " --reps " + std::to_string(f.reps);
  const std::string threads = " --io-threads " + std::to_string(f.io_threads);
  std::vector<json> rows;
  for (int n : f.worlds) {
    const std::string d = dir + "/w" + std::to_string(n);
    ::mkdir(d.c_str(), 0755);
    const auto save = ours(n, "save --dir " + d + "/ours" + reps + threads);
    const auto direct = ours(n, "save --dir " + d + "/direct --direct" + reps + threads);
    const auto load = ours(n, "load --dir " + d + "/ours" + reps + threads);
    const auto async = ours(n, "async --dir " + d + "/async --async-reps " + std::to_string(f.async_reps))[0];
    const json dsave =
        dcp(n, "save --dir " + d + "/dcp" + reps + " --async-reps " + std::to_string(std::min(f.async_reps, 5)));
    const json dload = dcp(n, "load --dir " + d + "/dcp" + reps);
    json row;
    row["world_size"] = n;
    row["bytes_total"] = save.back().at("bytes_total");
    row["save_s"] = median_of(save, "save_s");
    row["save_over_raw_write"] = median_of(save, "save_over_raw");
    row["save_direct_over_raw_direct_write"] = median_of(direct, "save_over_raw");
    row["save_MBps"] = median_of(save, "save_MBps");
    row["raw_write_MBps"] = median_of(save, "raw_MBps");
    row["load_s"] = median_of(load, "load_s");
    row["load_over_raw_read"] = median_of(load, "load_over_raw");
    row["read_bytes_over_needed"] = load.back().at("read_over_needed");
    row["async_stall_s"] = async.at("async_stall_s_median");
    row["async_stall_over_sync_save"] = async.at("stall_over_sync_save");
    row["async_stall_over_memcpy"] = async.at("stall_over_memcpy");
    row["step_slowdown_during_async"] =
        async.at("steps_during_async").get<int>() > 0
            ? async.at("step_s_during_async").get<double>() / async.at("step_s_plain").get<double>()
            : 0.0;
    row["host_peak_bytes"] = async.at("host_peak_bytes");
    row["async_saves"] = f.async_reps;
    row["rss_first_last_async"] = {async.at("rss_after_each_async").front(), async.at("rss_after_each_async").back()};
    row["dcp_save_s"] = dsave.at("save_s_median");
    row["save_over_dcp"] = row["save_s"].get<double>() / dsave.at("save_s_median").get<double>();
    row["dcp_load_s"] = dload.at("load_s_median");
    row["load_over_dcp"] = row["load_s"].get<double>() / dload.at("load_s_median").get<double>();
    row["dcp_read_bytes_over_needed"] = dload.at("read_over_needed");
    row["dcp_async_stall_s"] = dsave.at("async_stall_s_median");
    row["async_stall_over_dcp_async_stall"] =
        async.at("async_stall_s_median").get<double>() / dsave.at("async_stall_s_median").get<double>();
    row["dcp_host_peak_bytes"] = dsave.at("host_peak_rss_bytes");
    row["bytes_on_disk"] = bytes_under(fsdp::checkpoint::latest_checkpoint(d + "/ours"));
    row["dcp_bytes_on_disk"] = dsave.at("bytes_on_disk");
    rows.push_back(row);
    if (n == f.worlds.back() && n > 1) {  // the resharding load: n -> n - 1 ranks
      const auto rload = ours(n - 1, "load --dir " + d + "/ours" + reps + threads);
      const json rdload = dcp(n - 1, "load --dir " + d + "/dcp" + reps);
      json r;
      r["world_size"] = n - 1;
      r["saved_world_size"] = n;
      r["load_s"] = median_of(rload, "load_s");
      r["load_over_raw_read"] = median_of(rload, "load_over_raw");
      r["read_bytes_over_needed"] = rload.back().at("read_over_needed");
      r["dcp_load_s"] = rdload.at("load_s_median");
      r["load_over_dcp"] = r["load_s"].get<double>() / rdload.at("load_s_median").get<double>();
      r["dcp_read_bytes_over_needed"] = rdload.at("read_over_needed");
      r["dcp_verified"] = rdload.at("verified");
      rows.push_back(r);
    }
    std::string rm = "rm -rf '" + d + "'";
    if (std::system(rm.c_str()) != 0) std::cerr << "ckpt_bench: could not remove " << d << std::endl;
  }
  for (const auto& r : rows) {
    if (f.json) {
      std::cout << r.dump() << std::endl;
      continue;
    }
    std::cout << (r.contains("saved_world_size") ? "reshard " + std::to_string(r["saved_world_size"].get<int>()) + "->"
                                                 : std::string("ranks "))
              << r["world_size"] << ":";
    for (const auto& [k, v] : r.items()) {
      if (k != "world_size" && k != "saved_world_size") std::cout << "  " << k << "=" << v.dump();
    }
    std::cout << std::endl;
  }
  if (f.dir.empty()) ::rmdir(dir.c_str());
  return 0;
}

int main(int argc, char** argv) {
  try {
    const Flags f = parse(argc, argv);
    if (f.mode == "simulate") return simulate_mode(f);
    if (f.mode == "compare") return compare_mode(f);
    TORCH_CHECK(f.mode == "save" || f.mode == "load" || f.mode == "async",
                "ckpt_bench: mode must be compare, save, load, async or simulate");
    TORCH_CHECK(!f.dir.empty(), "ckpt_bench ", f.mode, ": --dir is required");
    at::set_num_threads(1);
    Job j;
    j.pg = fsdp::init_process_group();
    j.rank = j.pg->getRank();
    j.world = j.pg->getSize();
    return f.mode == "save" ? save_mode(f, j) : f.mode == "load" ? load_mode(f, j) : async_mode(f, j);
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";
    return 1;
  }
}
