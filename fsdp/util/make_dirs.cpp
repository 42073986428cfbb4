#include "fsdp/util/make_dirs.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

namespace fsdp::util {

std::string make_dirs(const std::string& dir) {
  for (size_t at = 1; at <= dir.size(); ++at) {
    if (at != dir.size() && dir[at] != '/') continue;
    const std::string part = dir.substr(0, at);
    if (::mkdir(part.c_str(), 0777) != 0 && errno != EEXIST) {
      return "cannot create directory '" + part + "': " + std::strerror(errno);
    }
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return "'" + dir + "' is not a directory";
  return "";
}

}  // namespace fsdp::util
