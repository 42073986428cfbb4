#include "checkpoint/internal/rng_state.h"

#include "checkpoint/internal/crc32c.h"
#include "fsdp/internal/check.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <mutex>

namespace fsdp::checkpoint::detail {
namespace {

int cuda_devices() {
  return at::hasCUDA() ? static_cast<int>(at::detail::getCUDAHooks().deviceCount()) : 0;
}

at::Generator generator(const std::string& name) {
  if (name == "cpu") return at::globalContext().defaultGenerator(at::Device(at::kCPU));
  return at::globalContext().defaultGenerator(at::Device(name));
}

// splitmix64: a full-period mix, so that nearby ranks get unrelated seeds.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace

std::string rng_prefix(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rng/rank-%05d/", rank);
  return buf;
}

std::vector<std::pair<std::string, at::Tensor>> rng_states() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::vector<std::string> names{"cpu"};
  for (int d = 0; d < cuda_devices(); ++d) names.push_back("cuda:" + std::to_string(d));
  for (const auto& name : names) {
    at::Generator g = generator(name);
    std::lock_guard<std::mutex> lock(g.mutex());
    out.emplace_back(name, g.get_state().contiguous());
  }
  return out;
}

bool set_rng_state(const std::string& name, const at::Tensor& state) {
  if (name != "cpu") {
    FSDP_CHECK(name.rfind("cuda:", 0) == 0, "fsdp::checkpoint: unknown generator '", name, "'.");
    if (std::stoi(name.substr(5)) >= cuda_devices()) return false;
  }
  at::Generator g = generator(name);
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
  return true;
}

void derive_rng_states(uint32_t base, int rank) {
  const uint64_t seed = mix((static_cast<uint64_t>(base) << 32) ^ static_cast<uint64_t>(rank));
  for (const auto& [name, state] : rng_states()) {
    (void)state;
    at::Generator g = generator(name);
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_current_seed(mix(seed ^ crc32c(name.data(), name.size())));
  }
}

}  // namespace fsdp::checkpoint::detail
