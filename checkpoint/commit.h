// The commit protocol of a checkpoint directory (docs/checkpoint-format.md, "Commit"): a save writes
// into a staging directory, and only a complete, fsynced checkpoint is renamed to its final name
// and then named by `latest`. A crash at any moment leaves either the previous checkpoint as the
// latest, or the new one complete; never a mix. The ranks' coordination (who creates, the barrier
// after every rank's files are fsynced) is the caller's; these are the filesystem steps, each
// done so that it survives a power cut (fsync of files and of the directories that name them).
#pragma once

#include "fsdp/export.h"

#include <cstdint>
#include <string>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::checkpoint {

/// The name of the file under a checkpoint root that names the latest committed checkpoint.
inline constexpr const char* kLatest = "latest";
/// The manifest's name inside a checkpoint directory; a directory without it is not a checkpoint.
inline constexpr const char* kManifest = "manifest.json";

/// The staging directory of a save of `name` under `root` ("<root>/.staging-<name>").
std::string staging_path(const std::string& root, const std::string& name);

/// Step 1 (one rank): removes the staging directories earlier saves left under `root` (a crash
/// mid-save; not those of this process's saves in flight), refuses `name` when a checkpoint of that name is committed
/// already (a save never writes into a committed checkpoint), and creates an empty staging directory for it, returning
/// its path. `root` is created if missing.
std::string begin_staging(const std::string& root, const std::string& name);

/// Ends what begin_staging began in this process (committed or not): until then, later saves in
/// this process leave its staging directory alone and refuse its name.
void end_staging(const std::string& root, const std::string& name);

/// fsyncs a file, or a directory (which makes the names in it durable).
void fsync_path(const std::string& path);

/// Writes `content` to `dir`/`name` atomically: a temporary file, fsynced, renamed over the name,
/// and the directory fsynced. Readers see the old file or the new one, whole.
void write_atomically(const std::string& dir, const std::string& name, const std::string& content);

/// Step 3 (one rank, after every rank's files and the manifest are in the staging directory and
/// fsynced): fsyncs the staging directory, renames it to `root`/`name`, fsyncs `root`, and points
/// `latest` at it (write_atomically). Returns the checkpoint's path.
std::string commit(const std::string& root, const std::string& staging, const std::string& name);

/// The latest committed checkpoint's directory under `root`, or "" when there is none. A `latest`
/// that names a directory without a manifest is an error (the root was tampered with).
std::string latest_checkpoint(const std::string& root);

/// The checkpoint `path` names: `path` itself when it holds a manifest, else the latest under it
/// (a root). Neither is an error that says so, naming `path`; a staging directory (a name starting
/// with '.') is never one.
std::string resolve_checkpoint(const std::string& path);

/// The committed checkpoints under `root` (directories with a manifest), oldest first by name.
std::vector<std::string> committed_checkpoints(const std::string& root);

/// Removes committed checkpoints beyond the newest `keep` (never the one `latest` names).
void keep_last(const std::string& root, int keep);

/// Removes `path` and everything below it, links as links; nothing if it is missing. False (errno
/// set) when something could not be removed. (Not std::filesystem::remove_all: the torch wheel's
/// libtorch.so exports a copy of it that crashed when the loader bound that one.)
bool remove_tree(const std::string& path);

/// "step-000100": the default name of the checkpoint of a step.
std::string step_name(int64_t step);

}  // namespace fsdp::checkpoint

FSDP_PUBLIC_END
