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
#include "checkpoint/checkpoint.h"
#include "checkpoint/commit.h"
#include "checkpoint/internal/manifest_builder.h"
#include "checkpoint/manifest.h"
#include "checkpoint/plan.h"
#include "checkpoint/safetensors.h"
#include "examples/gpt.h"
#include "examples/strategy_flags.h"
#include "fsdp/fsdp.h"

#include <torch/optim/adamw.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
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
  std::vector<int> ranks{128, 256, 512, 1024};
};

Flags parse(int argc, char** argv) {
  Flags f;
  f.model.n_layer = 8;
  f.model.n_embd = 512;
  f.model.n_head = 8;
  TORCH_CHECK(argc >= 2, "usage: ckpt_bench save|load --dir D | simulate [--ranks 128,1024] [--n-layer L --n-embd C]");
  f.mode = argv[1];
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--dir") {
      f.dir = v;
    } else if (k == "--n-layer") {
      f.model.n_layer = std::stoll(v);
    } else if (k == "--n-embd") {
      f.model.n_embd = std::stoll(v);
    } else if (k == "--strategy") {
      TORCH_CHECK(gpt::strategy_flags().count(v) == 1, "ckpt_bench: unknown --strategy ", v);
      f.strategy = v;
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

// `src` (the bytes, in memory, as a save's tensors are) written to `path` in kIo writes, fsynced.
void raw_write(const std::string& path, const std::vector<char>& src) {
  const auto bytes = static_cast<int64_t>(src.size());
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "cannot create ", path);
  for (int64_t done = 0; done < bytes;) {
    const ssize_t w = ::write(fd, src.data() + done, static_cast<size_t>(std::min<int64_t>(kIo, bytes - done)));
    TORCH_CHECK(w > 0, "write to ", path, " failed");
    done += w;
  }
  TORCH_CHECK(::fsync(fd) == 0, "fsync of ", path, " failed");
  ::close(fd);
}

// `bytes` from the raw files, taken as one stream, from `offset` on, into `dst` (memory that holds
// them all, as a load's does), in kIo reads.
void raw_read(const std::string& dir, int files, int64_t offset, int64_t bytes, std::vector<char>& dst) {
  char* out = dst.data();
  for (int f = 0; f < files && bytes > 0; ++f) {
    const std::string path = raw_file(dir, f);
    struct stat st {};
    TORCH_CHECK(::stat(path.c_str(), &st) == 0, "no ", path, ": run ckpt_bench save first");
    if (offset >= st.st_size) {
      offset -= st.st_size;
      continue;
    }
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ::lseek(fd, offset, SEEK_SET);
    for (int64_t left = std::min<int64_t>(bytes, st.st_size - offset); left > 0;) {
      const ssize_t r = ::read(fd, out, static_cast<size_t>(std::min<int64_t>(kIo, left)));
      TORCH_CHECK(r > 0, "read of ", path, " failed");
      out += r;
      left -= r;
      bytes -= r;
    }
    ::close(fd);
    offset = 0;
  }
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
        res = fsdp::checkpoint::save(
            f.dir, model, *opt,
            fsdp::checkpoint::SaveOptions().name("rep-" + std::to_string(rep)).step(rep).keep_last(1));
      });
      mine = res.bytes_written;
    };
    auto raw = [&] {
      const std::vector<char> src(static_cast<size_t>(mine), 'x');  // in memory (touched) before the clock
      raw_s = timed(j.pg, [&] { raw_write(raw_file(f.dir, j.rank), src); });
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
          "{\"mode\": \"save\", \"rep\": %d, \"ranks\": %d, \"strategy\": \"%s\", \"order\": \"%s\", "
          "\"bytes_total\": %lld, "
          "\"save_s\": %.4f, \"raw_write_s\": %.4f, \"save_over_raw\": %.3f, \"save_MBps\": %.1f, "
          "\"raw_MBps\": %.1f, \"per_rank_bytes_max_over_mean\": %.4f, \"per_rank_bytes\": %s}\n",
          rep, j.world, f.strategy.c_str(), rep % 2 == 0 ? "save first" : "raw first",
          static_cast<long long>(res.bytes_total), save_s, raw_s, save_s / raw_s, total / save_s / 1e6,
          total / raw_s / 1e6, mx / (total / j.world),
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
      load_s = timed(j.pg, [&] { res = fsdp::checkpoint::load(ckpt, model, *opt); });
    };
    auto raw = [&] {
      if (j.rank == 0) drop_cache(f.dir);
      auto mine = torch::zeros({j.world}, torch::kLong);
      mine[j.rank] = res.bytes_read;
      fsdp::all_reduce(j.pg, mine);
      const int64_t offset = j.rank == 0 ? 0 : mine.narrow(0, 0, j.rank).sum().item<int64_t>();
      std::vector<char> dst(static_cast<size_t>(res.bytes_read), 0);  // touched before the clock
      raw_s = timed(j.pg, [&] { raw_read(f.dir, saved_ranks, offset, res.bytes_read, dst); });
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
          "{\"mode\": \"load\", \"rep\": %d, \"ranks\": %d, \"saved_by\": %d, \"order\": \"%s\", "
          "\"bytes_needed_total\": %lld, \"bytes_read_total\": %lld, \"read_over_needed\": %.4f, "
          "\"manifest_bytes\": %lld, \"preads_rank0\": %lld, \"files_rank0\": %lld, \"load_s\": %.4f, "
          "\"raw_read_s\": %.4f, \"load_over_raw\": %.3f, \"load_MBps\": %.1f, \"raw_MBps\": %.1f}\n",
          rep, j.world, res.saved_world_size, rep % 2 == 0 ? "load first" : "raw first",
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

int main(int argc, char** argv) {
  try {
    const Flags f = parse(argc, argv);
    if (f.mode == "simulate") return simulate_mode(f);
    TORCH_CHECK(f.mode == "save" || f.mode == "load", "ckpt_bench: mode must be save, load or simulate");
    TORCH_CHECK(!f.dir.empty(), "ckpt_bench ", f.mode, ": --dir is required");
    at::set_num_threads(1);
    Job j;
    j.pg = fsdp::init_process_group();
    j.rank = j.pg->getRank();
    j.world = j.pg->getSize();
    return f.mode == "save" ? save_mode(f, j) : load_mode(f, j);
  } catch (const c10::Error& e) {
    std::cerr << "ckpt_bench: " << e.what_without_backtrace() << "\n";
    return 1;
  }
}
