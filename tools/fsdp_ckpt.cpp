// fsdp-ckpt: look into a sharded checkpoint (docs/checkpoint-format.md).
//
//   fsdp-ckpt inspect DIR   what was saved: step, world size, strategies, files, tensors
//   fsdp-ckpt verify DIR    every file against the manifest and every checksum, in parallel
//                           threads; exit status 1 on any fault, each named
//   fsdp-ckpt consolidate DIR OUT [--max-shard-bytes N] [--optimizer]
//                           Hugging Face-style safetensors files in the new directory OUT
//                           (checkpoint/consolidate.h)
//
// DIR is a checkpoint directory, or a root with a `latest` pointer.
#include "checkpoint/commit.h"
#include "checkpoint/consolidate.h"
#include "checkpoint/internal/crc32c.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "programs/flags.h"
#include "programs/program.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace fsdp::checkpoint;

std::string shape_text(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << c10::IntArrayRef(s);  // "[13, 7]"
  return os.str();
}

int inspect(const std::string& dir) {
  const Manifest m = read_manifest(resolve_checkpoint(dir));
  uint64_t total = 0;
  for (const auto& t : m.tensors) total += t.bytes();
  std::printf("checkpoint %s: '%s', step %lld, saved by %d ranks, format %d, libtorch-fsdp %s\n", m.dir.c_str(),
              m.name.c_str(), static_cast<long long>(m.step), m.world_size, m.format_version,
              m.library_version.c_str());
  std::printf("strategies:");
  for (const auto& [unit, s] : m.strategies) std::printf(" %s=%s", unit.c_str(), s.c_str());
  std::printf("\nmetadata:");
  for (const auto& [k, v] : m.metadata) std::printf(" %s=%s", k.c_str(), v.c_str());
  std::printf("\nfiles (%zu):\n", m.files.size());
  for (const auto& f : m.files)
    std::printf("  %s  rank %d  %llu bytes\n", f.name.c_str(), f.rank, static_cast<unsigned long long>(f.bytes));
  std::printf("tensors (%zu, %llu bytes):\n", m.tensors.size(), static_cast<unsigned long long>(total));
  for (const auto& t : m.tensors) {
    // Tensor-parallel parts: chunks that hold part of the width, in how many boxes.
    std::set<std::vector<int64_t>> boxes;
    for (const auto& c : t.chunks) boxes.insert(c.inner.offsets);
    const std::string parts = boxes.size() > 1 ? "  in " + std::to_string(boxes.size()) + " parts of its width" : "";
    std::printf("  %-40s %-9s %-5s %-16s %10llu bytes  %zu chunks%s\n", t.key.c_str(), t.kind.c_str(), t.dtype.c_str(),
                shape_text(t.shape).c_str(), static_cast<unsigned long long>(t.bytes()), t.chunks.size(),
                parts.c_str());
  }
  return 0;
}

int verify(const std::string& dir) {
  const Manifest m = read_manifest(resolve_checkpoint(dir));
  std::vector<std::string> faults;
  std::mutex mu;
  auto fault = [&](const std::string& f) {
    std::lock_guard<std::mutex> lock(mu);
    faults.push_back(f);
  };
  std::vector<bool> file_ok(m.files.size(), false);
  for (size_t i = 0; i < m.files.size(); ++i) {
    const std::string path = m.dir + "/" + m.files[i].name;
    try {
      const FileRecord h = read_safetensors_header(path);
      if (h.size != m.files[i].bytes) {
        fault("'" + path + "' has " + std::to_string(h.size) + " bytes, the manifest says " +
              std::to_string(m.files[i].bytes));
      } else {
        file_ok[i] = true;
      }
    } catch (const c10::Error& e) {
      fault(e.what_without_backtrace());
    }
  }
  // Every chunk's blocks, spread over threads.
  struct Job {
    const ManifestTensor* t;
    const ManifestChunk* c;
  };
  std::vector<Job> jobs;
  uint64_t bytes = 0;
  for (const auto& t : m.tensors) {
    for (const auto& c : t.chunks) {
      if (file_ok[c.file]) jobs.push_back({&t, &c});
      bytes += c.end - c.begin;
    }
  }
  std::atomic<size_t> next{0};
  auto work = [&] {
    std::vector<uint8_t> buf;
    for (size_t j = next++; j < jobs.size(); j = next++) {
      const auto& [t, c] = jobs[j];
      const std::string path = m.dir + "/" + m.files[c->file].name;
      try {
        buf.resize(c->end - c->begin);
        read_bytes(path, c->begin, buf.size(), buf.data());
        for (size_t b = 0; b < c->crc32c.size(); ++b) {
          const uint64_t off = b * c->block_bytes, n = std::min<uint64_t>(c->block_bytes, buf.size() - off);
          const uint32_t got = crc32c(buf.data() + off, n);
          if (got != c->crc32c[b]) {
            char text[64];
            std::snprintf(text, sizeof(text), "0x%08x, the manifest says 0x%08x", got, c->crc32c[b]);
            fault("'" + path + "': tensor '" + t->key + "' rows " + std::to_string(c->row_begin) + " to " +
                  std::to_string(c->row_end) + ", bytes " + std::to_string(c->begin + off) + " to " +
                  std::to_string(c->begin + off + n) + ": checksum " + text);
          }
        }
      } catch (const c10::Error& e) {
        fault(e.what_without_backtrace());
      }
    }
  };
  const size_t threads = std::max<size_t>(1, std::min<size_t>(std::thread::hardware_concurrency(), jobs.size()));
  std::vector<std::thread> pool;
  for (size_t i = 0; i < threads; ++i) pool.emplace_back(work);
  for (auto& th : pool) th.join();
  if (!faults.empty()) {
    std::sort(faults.begin(), faults.end());
    std::fprintf(stderr, "fsdp-ckpt verify: %s: %zu fault(s):\n", m.dir.c_str(), faults.size());
    for (const auto& f : faults) std::fprintf(stderr, "  %s\n", f.c_str());
    return 1;
  }
  std::printf("fsdp-ckpt verify: %s: OK (%zu files, %zu tensors, %llu bytes, %zu threads)\n", m.dir.c_str(),
              m.files.size(), m.tensors.size(), static_cast<unsigned long long>(bytes), threads);
  return 0;
}

const char* const kSynopsis =
    "usage: fsdp-ckpt inspect DIR | fsdp-ckpt verify DIR | fsdp-ckpt consolidate DIR OUT [--max-shard-bytes N] "
    "[--optimizer]";

const char* const kAbout =
    "  inspect: what was saved; verify: every file and checksum (exit status 1 on any fault);\n"
    "  consolidate: Hugging Face-style safetensors files in the new directory OUT.\n"
    "  DIR is a checkpoint directory, or a root with a `latest` pointer.\n";

int run(int argc, char** argv) {
  ConsolidateOptions o;
  bool optimizer = false, max_given = false;
  fsdp::programs::Flags flags("fsdp-ckpt", kAbout);
  flags.positionals("inspect DIR | verify DIR | consolidate DIR OUT", 0, 3)
      .toggle("--optimizer", optimizer, "consolidate: the optimizer state too")
      .custom("--max-shard-bytes", "N", "consolidate: the most bytes of one output file", [&](const std::string& v) {
        o.max_shard_bytes(fsdp::programs::parse_uint64("--max-shard-bytes", v));
        max_given = true;
      });
  const std::vector<std::string> args = flags.parse(argc, argv);
  const std::string cmd = args.empty() ? "" : args[0];
  if (cmd.empty()) fsdp::programs::usage_error(std::string("a command is needed; ") + kSynopsis);
  if (cmd != "inspect" && cmd != "verify" && cmd != "consolidate") {
    fsdp::programs::usage_error("unknown command '" + cmd + "': inspect, verify or consolidate");
  }
  const size_t want = cmd == "consolidate" ? 3 : 2;
  if (args.size() != want) {
    fsdp::programs::usage_error(cmd + (cmd == "consolidate" ? " takes DIR OUT" : " takes DIR"));
  }
  if (cmd != "consolidate" && (optimizer || max_given)) {
    fsdp::programs::usage_error("--optimizer and --max-shard-bytes are consolidate's");
  }
  if (cmd == "inspect") return inspect(args[1]);
  if (cmd == "verify") return verify(args[1]);
  const auto r = consolidate(args[1], args[2], o.optimizer(optimizer));
  std::printf("fsdp-ckpt consolidate: %s: %llu bytes of tensors in %zu file(s):\n", r.dir.c_str(),
              static_cast<unsigned long long>(r.tensor_bytes), r.files.size());
  for (const auto& f : r.files) std::printf("  %s\n", f.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::programs::Program("fsdp-ckpt").main([&] { return run(argc, argv); });
}
