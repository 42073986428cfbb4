#include "checkpoint/commit.h"

#include "checkpoint/internal/crash_point.h"
#include "checkpoint/internal/parallel_io.h"
#include "fsdp/internal/check.h"
#include "fsdp/util/json_text.h"
#include "fsdp/util/make_dirs.h"

#include <c10/util/Exception.h>

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>

namespace fsdp::checkpoint {
namespace {

constexpr const char* kStagingPrefix = ".staging-";
// A committed checkpoint being replaced by a new save of its name (see begin_staging).
constexpr const char* kReplacedPrefix = ".replaced-";
// A checkpoint beyond keep_last, out of the committed set, being deleted (see keep_last).
constexpr const char* kDeletingPrefix = ".deleting-";

std::string system_error() {
  return std::strerror(errno);
}

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  FSDP_CHECK(d != nullptr, "fsdp::checkpoint: cannot list '", dir, "': ", system_error());
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

// The staging directories of this process's saves in flight (an AsyncSaver's while a synchronous
// save starts, say): never taken for a crashed save's leftovers.
std::mutex g_staging_mu;
std::set<std::string>& in_flight() {
  static auto* s = new std::set<std::string>();  // never destroyed: saves may run at exit
  return *s;
}

// remove_tree, or an error naming the path.
void remove_or_throw(const std::string& path) {
  FSDP_CHECK(remove_tree(path), "fsdp::checkpoint: cannot remove '", path, "': ", system_error());
}

void check_name(const std::string& name) {
  FSDP_CHECK(!name.empty() && name.find('/') == std::string::npos && name[0] != '.' && name != kLatest,
             "fsdp::checkpoint: '", name,
             "' cannot name a checkpoint: use a plain directory name, without '/', not starting with '.', and "
             "not '",
             kLatest, "'.");
}

}  // namespace

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%06lld", static_cast<long long>(step));
  return buf;
}

std::string staging_path(const std::string& root, const std::string& name) {
  return root + "/" + kStagingPrefix + name;
}

std::string begin_staging(const std::string& root, const std::string& name) {
  check_name(name);
  if (const std::string e = fsdp::util::make_dirs(root); !e.empty()) {
    FSDP_CHECK(false, "fsdp::checkpoint: ", e, ": cannot save under '", root, "'.");
  }
  const std::string staging = staging_path(root, name);
  std::lock_guard<std::mutex> lock(g_staging_mu);
  FSDP_CHECK(in_flight().count(staging) == 0, "fsdp::checkpoint: a save of '", name, "' under '", root,
             "' is still in flight in this process (an AsyncSaver's): wait() for it before saving that name again.");
  // What a save that crashed left: staging directories (not those of this process's saves in
  // flight), a half-written `latest`, a checkpoint half replaced or half deleted.
  for (const auto& e : entries(root)) {
    if (in_flight().count(root + "/" + e) != 0) continue;
    if (e.rfind(kStagingPrefix, 0) == 0 || e.rfind(kReplacedPrefix, 0) == 0 || e.rfind(kDeletingPrefix, 0) == 0 ||
        e == std::string(".") + kLatest + ".tmp") {
      remove_or_throw(root + "/" + e);
    }
  }
  // A committed checkpoint of this name that `latest` names is refused; one it does not name (a
  // save that crashed after its rename and before `latest`, or a run that went back to an earlier
  // checkpoint and got here again) is replaced at the commit, atomically.
  const std::string final_dir = root + "/" + name;
  FSDP_CHECK(!exists(final_dir) || (exists(final_dir + "/" + kManifest) && latest_checkpoint(root) != final_dir),
             "fsdp::checkpoint: '", final_dir, "' exists already and ",
             exists(final_dir + "/" + kManifest) ? "is the latest checkpoint" : "is not a checkpoint",
             "; a save never writes into it. Save under another name (the step, say), or remove it first.");
  FSDP_CHECK(::mkdir(staging.c_str(), 0755) == 0, "fsdp::checkpoint: cannot create the staging directory '", staging,
             "': ", system_error());
  in_flight().insert(staging);
  return staging;
}

void end_staging(const std::string& root, const std::string& name) {
  std::lock_guard<std::mutex> lock(g_staging_mu);
  in_flight().erase(staging_path(root, name));
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  FSDP_CHECK(fd >= 0, "fsdp::checkpoint: cannot open '", path, "' to fsync it: ", system_error());
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  errno = err;
  FSDP_CHECK(rc == 0, "fsdp::checkpoint: fsync of '", path, "' failed: ", system_error());
}

void write_atomically(const std::string& dir, const std::string& name, const std::string& content) {
  const std::string tmp = dir + "/." + name + ".tmp", path = dir + "/" + name;
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << content;
    f.flush();
    FSDP_CHECK(f.good(), "fsdp::checkpoint: cannot write '", tmp, "'");
  }
  fsync_path(tmp);
  detail::crash_point(name == kLatest ? "latest-written" : "manifest-written", 0);
  FSDP_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "fsdp::checkpoint: cannot rename '", tmp, "' to '", path,
             "': ", system_error());
  fsync_path(dir);
  detail::crash_point(name == kLatest ? "latest-renamed" : "manifest-renamed", 0);
}

std::string commit(const std::string& root, const std::string& staging, const std::string& name) {
  check_name(name);
  FSDP_CHECK(exists(staging + "/" + kManifest), "fsdp::checkpoint: '", staging, "' has no ", kManifest,
             ": only a complete checkpoint is committed.");
  fsync_path(staging);
  const std::string final_dir = root + "/" + name;
  // A committed checkpoint of this name that begin_staging allowed (not the latest) is moved aside
  // first; a crash before the new one's rename leaves it under a '.' name, which nothing loads and
  // the next save removes.
  const std::string replaced = root + "/" + kReplacedPrefix + name;
  const bool replacing = exists(final_dir);
  if (replacing) {
    FSDP_CHECK(latest_checkpoint(root) != final_dir, "fsdp::checkpoint: '", final_dir,
               "' became the latest checkpoint during the save; not replacing it.");
    FSDP_CHECK(::rename(final_dir.c_str(), replaced.c_str()) == 0, "fsdp::checkpoint: cannot move '", final_dir,
               "' aside to replace it: ", system_error());
  }
  FSDP_CHECK(::rename(staging.c_str(), final_dir.c_str()) == 0, "fsdp::checkpoint: cannot rename '", staging, "' to '",
             final_dir, "': ", system_error());
  fsync_path(root);
  detail::crash_point("directory-renamed", 0);
  write_atomically(root, kLatest, name + "\n");
  if (replacing) remove_or_throw(replaced);
  return final_dir;
}

std::string latest_checkpoint(const std::string& root) {
  std::ifstream f(root + "/" + kLatest);
  if (!f) return "";
  std::string name;
  std::getline(f, name);
  const bool printable =
      std::none_of(name.begin(), name.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20; });
  FSDP_CHECK(!name.empty() && name.find('/') == std::string::npos && printable, "fsdp::checkpoint: '", root, "/",
             kLatest, "' does not name a checkpoint (it holds ", fsdp::util::json_string(name),
             "): it was damaged or written by something else. Write the name of a committed checkpoint into it, or "
             "load one by its directory.");
  const std::string dir = root + "/" + name;
  FSDP_CHECK(exists(dir + "/" + kManifest), "fsdp::checkpoint: '", root, "/", kLatest, "' names '", name,
             "', which is not a committed checkpoint (no ", kManifest, " in '", dir,
             "'). Something other than this library changed the directory.");
  return dir;
}

std::string resolve_checkpoint(const std::string& path) {
  const size_t slash = path.find_last_of('/', path.size() > 1 ? path.size() - 2 : 0);
  const std::string base = path.substr(slash == std::string::npos ? 0 : slash + 1);
  FSDP_CHECK(base.empty() || base[0] != '.' || base == "." || base == "..", "fsdp::checkpoint: '", path,
             "' is a staging directory of a save that did not finish: it is never loaded. Load a committed "
             "checkpoint (the root, for its latest).");
  if (exists(path + "/" + kManifest)) return path;
  FSDP_CHECK(exists(path), "fsdp::checkpoint: '", path,
             "' does not exist: give a checkpoint directory, or the root a save wrote into.");
  const std::string latest = latest_checkpoint(path);
  FSDP_CHECK(!latest.empty(), "fsdp::checkpoint: '", path, "' is neither a checkpoint (no ", kManifest,
             ") nor a root with a '", kLatest, "' pointer", is_dir(path) ? "" : " (it is not a directory)",
             ": give a checkpoint directory, or the root a save wrote into.");
  return latest;
}

std::vector<std::string> committed_checkpoints(const std::string& root) {
  std::vector<std::string> out;
  if (!is_dir(root)) return out;
  for (const auto& e : entries(root)) {
    if (e[0] != '.' && exists(root + "/" + e + "/" + kManifest)) out.push_back(root + "/" + e);
  }
  return out;
}

void keep_last(const std::string& root, int keep) {
  if (keep <= 0) return;
  const std::string latest = latest_checkpoint(root);
  auto all = committed_checkpoints(root);
  const auto excess = static_cast<int64_t>(all.size()) - keep;
  // Each one leaves the committed set at once, by a rename (a crash while its files are deleted
  // never leaves a manifest over missing files; the next save removes what is left)...
  std::vector<std::string> going;
  for (int64_t i = 0; i < excess; ++i) {
    if (all[i] == latest) continue;
    const std::string name = all[i].substr(all[i].rfind('/') + 1);
    going.push_back(root + "/" + kDeletingPrefix + name);
    remove_or_throw(going.back());  // a leftover of a crash, if any
    FSDP_CHECK(::rename(all[i].c_str(), going.back().c_str()) == 0, "fsdp::checkpoint: cannot rename '", all[i],
               "' to '", going.back(), "' to delete it (keep_last): ", system_error());
  }
  if (going.empty()) return;
  fsync_path(root);
  // ... then its files are unlinked on several threads: freeing a large file's blocks and cached
  // pages is the kernel's CPU work, and this rank (rank 0) would otherwise do it for every rank's
  // file while the other ranks wait for the save's last agreement with their cores idle.
  std::vector<std::string> files;
  for (const auto& dir : going) {
    for (const auto& e : entries(dir)) files.push_back(dir + "/" + e);
  }
  detail::run_parallel(files.size(), 8, [&](int, size_t i) { ::unlink(files[i].c_str()); });  // what fails: below
  for (const auto& dir : going) remove_or_throw(dir);  // the directory, and anything not unlinked
}

bool remove_tree(const std::string& path) {
  auto rm = [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); };
  return ::nftw(path.c_str(), rm, 16, FTW_DEPTH | FTW_PHYS) == 0 || errno == ENOENT;
}

}  // namespace fsdp::checkpoint
