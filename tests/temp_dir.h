// A fresh directory for one test, removed with everything in it at the end. (Not
// std::filesystem: libtorch.so exports a copy of its symbols that crashes when called.)
#pragma once

#include <c10/util/Exception.h>

#include <ftw.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cstdio>
#include <string>

namespace fsdp::testing {

/// Removes `path` and everything below it (nothing if it is missing).
inline void remove_tree(const std::string& path) {
  ::nftw(
      path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/fsdp-test-dir-XXXXXX";
    TORCH_CHECK(mkdtemp(tmpl) != nullptr, "mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() { remove_tree(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

}  // namespace fsdp::testing
