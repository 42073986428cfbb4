#include "checkpoint/internal/safetensors_manifest.h"

#include "checkpoint/safetensors.h"
#include "fsdp/internal/check.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <fstream>
#include <vector>

namespace fsdp::checkpoint::detail {

Manifest safetensors_manifest(const std::string& path, const std::set<std::string>& buffers,
                              const std::function<std::string(const std::string&)>& name_map) {
  std::vector<std::string> files;
  std::string dir = path;
  struct stat st {};
  const bool is_dir = ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  std::string index = is_dir ? path + "/model.safetensors.index.json" : path;
  if (is_dir && ::stat(index.c_str(), &st) != 0) {
    index.clear();
    files.push_back("model.safetensors");
  } else if (!is_dir && (path.size() < 5 || path.compare(path.size() - 5, 5, ".json") != 0)) {
    index.clear();
    const size_t slash = path.find_last_of('/');
    dir = slash == std::string::npos ? "." : path.substr(0, slash);
    files.push_back(path.substr(slash == std::string::npos ? 0 : slash + 1));
  }
  if (!index.empty()) {
    std::ifstream f(index);
    FSDP_CHECK(f, "cannot open '", index, "'.");
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(f);
      std::set<std::string> unique;
      for (const auto& [name, file] : j.at("weight_map").items()) unique.insert(file.get<std::string>());
      files.assign(unique.begin(), unique.end());
    } catch (const nlohmann::json::exception& e) {
      FSDP_CHECK(false, "'", index, "' is not a safetensors index (", e.what(), ").");
    }
    const size_t slash = index.find_last_of('/');
    dir = slash == std::string::npos ? "." : index.substr(0, slash);
  }
  Manifest m;
  m.dir = dir;
  m.name = path;
  m.world_size = static_cast<int>(files.size());
  std::set<std::string> keys;
  for (size_t i = 0; i < files.size(); ++i) {
    FSDP_CHECK(files[i].find('/') == std::string::npos, "'", files[i], "' is not a file name in '", dir, "'.");
    const FileRecord rec = read_safetensors_header(dir + "/" + files[i]);
    m.files.push_back({files[i], static_cast<int>(i), rec.size});
    for (const TensorRecord& t : rec.tensors) {
      const std::string name = name_map ? name_map(t.name) : t.name;
      if (name.empty()) continue;
      ManifestTensor mt;
      mt.key = "model/" + name;
      FSDP_CHECK(keys.insert(mt.key).second, "two tensors of '", path, "' are named '", name,
                 "' (after the name map): one is in '", files[i], "'.");
      mt.kind = buffers.count(name) != 0 ? "buffer" : "parameter";
      mt.dtype = t.dtype;
      mt.shape = t.shape;
      if (t.end > t.begin && mt.rows() > 0) {
        ManifestChunk c;
        c.row_end = mt.rows();
        c.file = i;
        c.begin = t.begin;
        c.end = t.end;
        mt.chunks.push_back(std::move(c));
      }
      m.tensors.push_back(std::move(mt));
    }
  }
  return m;
}

}  // namespace fsdp::checkpoint::detail
