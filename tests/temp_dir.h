// A fresh directory for one test, removed with everything in it at the end
// (fsdp::checkpoint::remove_tree).
#pragma once

#include "checkpoint/commit.h"

#include <c10/util/Exception.h>

#include <stdlib.h>

#include <string>

namespace fsdp::testing {

using fsdp::checkpoint::remove_tree;

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/fsdp-test-dir-XXXXXX";
    TORCH_CHECK(mkdtemp(tmpl) != nullptr, "mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() { (void)remove_tree(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

}  // namespace fsdp::testing
