// Fault injection for the crash-safety and disk-error tests (docs/checkpoint-format.md, "Crash safety"): with
// FSDP_CHECKPOINT_CRASH_AT="<point>@<rank>" in its environment, the process of that rank SIGKILLs
// itself when a save reaches <point>, as a node that dies there would; "<point>@<rank>:stop" makes
// it SIGSTOP itself there instead, as a process that hangs. Unset (always, outside
// tests), a crash point costs one cached lookup. Internal to the checkpoint library.
#pragma once

#include <string>

namespace fsdp::checkpoint::detail {

/// The points of a save, in order (`rank`: the caller's).
///   staged             rank 0 created the staging directory
///   data-written       this rank's file is written, not yet fsynced
///   data-fsynced       ... and fsynced
///   agreed             every rank said its file is durable
///   manifest-written   rank 0: the manifest under its temporary name, fsynced, not renamed
///   manifest-renamed   ... renamed to manifest.json, the staging directory fsynced
///   directory-renamed  rank 0: the staging directory renamed to its final name, the root fsynced
///   latest-written     rank 0: the new `latest` under its temporary name, not renamed
///   latest-renamed     ... renamed: the save is complete
void crash_point(const char* point, int rank);

/// With FSDP_CHECKPOINT_FAIL_WRITE="<ENOSPC|EIO>:<text>", a write to a file whose path contains
/// <text> fails with that errno, as on a full or failing disk: the error code to fail with, or 0.
int injected_write_error(const std::string& path);

}  // namespace fsdp::checkpoint::detail
