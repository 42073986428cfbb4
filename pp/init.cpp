#include "pp/init.h"

#include "fsdp/internal/core_access.h"

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

namespace fsdp::pp {

at::Generator parameter_generator(uint64_t seed, const std::string& name) {
  // The library's one hash of values and strings (fsdp/internal/calls.h): stable across versions
  // of LibTorch and compilers, unlike std::hash.
  return at::make_generator<at::CPUGeneratorImpl>(detail::Fingerprint().add(seed).add(name).value());
}

uint64_t draw_seed() {
  auto gen = at::detail::getDefaultCPUGenerator();
  const std::lock_guard<std::mutex> lock(gen.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
}

}  // namespace fsdp::pp
