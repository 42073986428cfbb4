// mkdir -p, for the files the library writes (a checkpoint's root, the flight recorder's dumps).
// Not std::filesystem: libtorch.so exports a copy of its symbols that crashes when called.
// Internal to the library.
#pragma once

#include "fsdp/export.h"

#include <string>

namespace fsdp::util {

/// Creates `dir` and every missing directory above it (mode 0777, less the umask). Returns "" on
/// success, else what failed ("cannot create directory '/a/b': Permission denied", "'/a/b' is not
/// a directory"). Never throws: the flight recorder calls it while reporting a failure.
FSDP_API std::string make_dirs(const std::string& dir);

}  // namespace fsdp::util
