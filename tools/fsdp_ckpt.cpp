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

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace fsdp::checkpoint;

constexpr int kUsage = 2;

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

int consolidate_command(int argc, char** argv) {
  ConsolidateOptions o;
  for (int i = 4; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--optimizer") {
      o.optimizer(true);
    } else if (k == "--max-shard-bytes" && i + 1 < argc) {
      const std::string v = argv[++i];
      char* end = nullptr;
      errno = 0;
      const unsigned long long n = std::strtoull(v.c_str(), &end, 10);
      if (v.empty() || v[0] == '-' || *end != '\0' || errno != 0) {
        std::cerr << "fsdp-ckpt consolidate: --max-shard-bytes takes a whole number of bytes, not '" << v << "'\n";
        return kUsage;
      }
      o.max_shard_bytes(n);
    } else {
      std::cerr << "fsdp-ckpt consolidate: unknown argument '" << k << "'\n";
      return kUsage;
    }
  }
  const auto r = consolidate(argv[2], argv[3], o);
  std::printf("fsdp-ckpt consolidate: %s: %llu bytes of tensors in %zu file(s):\n", r.dir.c_str(),
              static_cast<unsigned long long>(r.tensor_bytes), r.files.size());
  for (const auto& f : r.files) std::printf("  %s\n", f.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const char* const usage =
      "usage: fsdp-ckpt inspect DIR | fsdp-ckpt verify DIR |\n"
      "       fsdp-ckpt consolidate DIR OUT [--max-shard-bytes N] [--optimizer]\n"
      "  inspect: what was saved; verify: every file and checksum (exit status 1 on any fault);\n"
      "  consolidate: Hugging Face-style safetensors files in the new directory OUT.\n"
      "  DIR is a checkpoint directory, or a root with a `latest` pointer.\n";
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
      std::cout << usage;
      return 0;
    }
  }
  const std::string cmd = argc > 1 ? argv[1] : "";
  const bool ok = (argc == 3 && (cmd == "inspect" || cmd == "verify")) || (argc >= 4 && cmd == "consolidate");
  if (!ok) {
    std::cerr << usage;
    return kUsage;
  }
  try {
    if (cmd == "consolidate") return consolidate_command(argc, argv);
    return cmd == "inspect" ? inspect(argv[2]) : verify(argv[2]);
  } catch (const c10::Error& e) {
    std::cerr << "fsdp-ckpt " << argv[1] << ": " << e.what_without_backtrace() << "\n";
    return 1;
  }
}
