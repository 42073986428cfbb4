// The checkpoint format's building blocks: CRC32C against published values, and the safetensors
// rank file: offsets and sizes from shapes, every dtype bit-exact, a broken file refused with its
// own error, and Python's safetensors reading what we write and we what it writes.
#include "checkpoint/internal/crc32c.h"
#include "checkpoint/internal/manifest_builder.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "tests/temp_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <string>

namespace fsdp::testing {
namespace {

using checkpoint::crc32c;

uint64_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

TEST(Crc32c, PublishedValues) {
  // RFC 3720 (iSCSI), appendix B.4, and the usual check value.
  const std::string check = "123456789";
  EXPECT_EQ(crc32c(check.data(), check.size()), 0xE3069283u);
  std::vector<uint8_t> zeros(32, 0), ones(32, 0xff), up(32);
  std::iota(up.begin(), up.end(), 0);
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(crc32c(up.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
}

TEST(Crc32c, ChunkedAndPortableAgree) {
  // Lengths around the hardware path's three-stream stretches (3 x 256 and 3 x 8192 bytes).
  std::vector<uint8_t> data(100007);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 131 + 7 + (i >> 11));
  for (size_t start : {0, 1, 3, 8}) {
    for (size_t n : {0, 1, 7, 8, 9, 64, 767, 768, 769, 1000, 9999, 24575, 24576, 24583, 50000, 99999}) {
      const uint8_t* p = data.data() + start;
      const uint32_t whole = crc32c(p, n);
      EXPECT_EQ(checkpoint::detail::crc32c_portable(p, n), whole) << start << " " << n;
      for (size_t cut : {size_t{0}, n / 3, n}) EXPECT_EQ(crc32c(p + cut, n - cut, crc32c(p, cut)), whole);
    }
  }
}

// Every dtype the format names, a scalar, an empty tensor and a transposed (non-contiguous) one.
std::vector<std::pair<std::string, torch::Tensor>> sample_tensors() {
  torch::manual_seed(3);
  std::vector<std::pair<std::string, torch::Tensor>> t = {
      {"w.f64", torch::randn({3, 5}, torch::kDouble)},
      {"w.f32", torch::randn({257, 3})},
      {"w.f16", torch::randn({4, 4}).to(torch::kHalf)},
      {"w.bf16", torch::randn({6}).to(torch::kBFloat16)},
      {"i.64", torch::randint(-1000, 1000, {7}, torch::kLong)},
      {"i.32", torch::randint(-1000, 1000, {2, 3}, torch::kInt)},
      {"i.16", torch::randint(-1000, 1000, {5}, torch::kShort)},
      {"i.8", torch::randint(-100, 100, {9}, torch::kChar)},
      {"u.8", torch::randint(0, 255, {3, 3}, torch::kByte)},
      {"b", torch::randint(0, 2, {11}).to(torch::kBool)},
      {"scalar", torch::tensor(2.5)},
      {"empty", torch::zeros({0, 4})},
      {"transposed", torch::arange(12, torch::kFloat).view({3, 4}).t()},
  };
  return t;
}

bool same_bytes(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.numel() * x.element_size()) == 0;
}

TEST(Safetensors, ChecksumBlocksShrinkForSmallTensorsInPages) {
  const uint64_t MiB = uint64_t{1} << 20, KiB = 1024;
  EXPECT_EQ(checkpoint::checksum_block(100 * MiB, MiB, 1), MiB);  // one block size for all
  EXPECT_EQ(checkpoint::checksum_block(100, MiB, 1), MiB);
  EXPECT_EQ(checkpoint::checksum_block(64 * MiB, MiB, 64), MiB);  // 64 blocks of the largest
  EXPECT_EQ(checkpoint::checksum_block(32 * MiB, MiB, 64), 512 * KiB);
  EXPECT_EQ(checkpoint::checksum_block(32 * MiB + 1, MiB, 64), 516 * KiB);  // rounded up to pages
  EXPECT_EQ(checkpoint::checksum_block(100 * KiB, MiB, 64), 4 * KiB);       // never under a page
  EXPECT_EQ(checkpoint::checksum_block(100 * KiB, 64, 64), 64u);            // nor over the largest
  // The block count of a tensor is then at most about min_blocks, and at least one.
  for (uint64_t bytes : {uint64_t{1}, 4 * KiB, 300 * KiB, 5 * MiB + 3, 70 * MiB}) {
    const uint64_t b = checkpoint::checksum_block(bytes, MiB, 64);
    const uint64_t blocks = (bytes + b - 1) / b;
    EXPECT_GE(blocks, 1u) << bytes;
    EXPECT_LE(blocks, std::max<uint64_t>(64, (bytes + MiB - 1) / MiB)) << bytes;
  }
}

TEST(Safetensors, OffsetsFromShapesAndEveryDtypeBitExact) {
  TempDir tmp;
  const std::string& dir = tmp.path;
  const std::string path = dir + "/rank-0.safetensors";
  const auto tensors = sample_tensors();
  const uint64_t block = 100;  // small blocks, so that tensors span several
  const auto rec =
      checkpoint::write_safetensors(path, tensors, {{"rank", "0"}}, checkpoint::WriteOptions().block_bytes(block));
  EXPECT_EQ(rec.data_start % 4096, 0u);
  EXPECT_EQ(rec.metadata.at("format"), "pt");
  uint64_t at = rec.data_start;
  ASSERT_EQ(rec.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    const auto& r = rec.tensors[i];
    const uint64_t bytes = t.numel() * t.element_size();
    EXPECT_EQ(r.name, name);
    EXPECT_EQ(r.begin, at) << name;
    EXPECT_EQ(r.end, at + bytes) << name;
    at += bytes;
    // One checksum per block of the tensor's bytes, as computed here from the tensor itself.
    const auto c = t.contiguous();
    const auto* p = static_cast<const uint8_t*>(c.data_ptr());
    ASSERT_EQ(r.block_bytes, block) << name;
    ASSERT_EQ(r.crc32c.size(), (bytes + block - 1) / block) << name;
    for (size_t b = 0; b < r.crc32c.size(); ++b) {
      EXPECT_EQ(r.crc32c[b], crc32c(p + b * block, std::min<uint64_t>(block, bytes - b * block))) << name;
    }
  }
  EXPECT_EQ(rec.size, at);
  EXPECT_EQ(file_size(path), rec.size);

  const auto back = checkpoint::read_safetensors_header(path);
  EXPECT_EQ(back.data_start, rec.data_start);
  EXPECT_EQ(back.metadata, rec.metadata);
  ASSERT_EQ(back.tensors.size(), tensors.size());
  for (const auto& r : back.tensors) {  // in file order, which is the written order
    const auto it = std::find_if(tensors.begin(), tensors.end(), [&](const auto& kv) { return kv.first == r.name; });
    ASSERT_NE(it, tensors.end()) << r.name;
    EXPECT_TRUE(same_bytes(checkpoint::read_tensor(path, r), it->second)) << r.name;
  }
}

// The header is written as text, not through a JSON tree: its bytes must be those nlohmann's
// compact dump of the same object gives (names and metadata that need escaping included), padded
// with spaces to the alignment.
TEST(Safetensors, HeaderIsTheCompactJsonOfItsTensors) {
  TempDir tmp;
  const std::string path = tmp.path + "/odd-names.safetensors";
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"plain.weight", torch::arange(6, torch::kFloat32).reshape({2, 3})},
      {"quote\"back\\slash/", torch::ones({4}, torch::kBFloat16)},
      {"ctl\n\t\r\b\f\x01\x1f", torch::zeros({0, 5}, torch::kInt64)},
      {"utf8-\xc3\xbc\xe2\x82\xac", torch::full({}, 7, torch::kInt32)}};
  const std::map<std::string, std::string> metadata = {{"rank", "0"}, {"note", "a \"quoted\"\nline"}};
  const auto rec = checkpoint::write_safetensors(path, tensors, metadata, checkpoint::WriteOptions());
  nlohmann::ordered_json want = nlohmann::ordered_json::object();
  auto meta = metadata;
  meta["format"] = "pt";
  want["__metadata__"] = meta;
  uint64_t at = 0;
  for (const auto& [name, t] : tensors) {
    const uint64_t n = t.numel() * t.element_size();
    want[name] = {{"dtype", checkpoint::safetensors_dtype(t.scalar_type())},
                  {"shape", t.sizes().vec()},
                  {"data_offsets", {at, at + n}}};
    at += n;
  }
  std::ifstream f(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  ASSERT_GE(bytes.size(), rec.data_start);
  std::string header = bytes.substr(8, rec.data_start - 8);
  header.erase(header.find_last_not_of(' ') + 1);
  EXPECT_EQ(header, want.dump());
  EXPECT_EQ(rec.data_start % 4096, 0u);
}

// A rank's part of the manifest crosses ranks as bytes: decoded as encoded, and a part that is cut
// short, carries bytes after its end or claims more items than it holds is refused (never read
// past its end), naming the rank. The manifest assembled from binary parts is the one
// manifest_from_parts assembles from the same parts as JSON.
TEST(ManifestPart, RoundTripsRefusesMalformedAndAssemblesAsTheJsonParts) {
  using checkpoint::detail::RankPart;
  RankPart part;
  part.file = "rank-00001.safetensors";
  part.file_bytes = 12345;
  part.tensors = {{"optim/w/exp_avg", "optimizer", "F32", {4, 3}}, {"rng/rank-00001/cpu", "rng", "U8", {16}}};
  part.steps = {{"w", 7}};
  part.chunks = {{"model/w", 2, 4, {}, 4096, 4120, 4096, {0xdeadbeefu}},
                 {"optim/w/exp_avg", 2, 4, {}, 4120, 4144, 4096, {1u}},
                 {"rng/rank-00001/cpu", 0, 16, {}, 4144, 4160, 4096, {2u}}};
  const std::string bytes = part.encode();
  const RankPart back = RankPart::decode(bytes, 1);
  EXPECT_EQ(back.encode(), bytes);
  EXPECT_EQ(back.file, part.file);
  ASSERT_EQ(back.chunks.size(), 3u);
  EXPECT_EQ(back.chunks[0].crc32c, std::vector<uint32_t>{0xdeadbeefu});
  EXPECT_EQ(back.chunks[1].row_end, 4);
  EXPECT_EQ(back.steps, part.steps);
  auto error_of = [](const std::string& b) {
    try {
      RankPart::decode(b, 3);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  for (size_t n : {size_t{0}, size_t{5}, size_t{40}, bytes.size() / 2, bytes.size() - 1}) {
    const std::string msg = error_of(bytes.substr(0, n));
    EXPECT_NE(msg.find("rank 3"), std::string::npos) << n << ": " << msg;
    EXPECT_NE(msg.find("same build"), std::string::npos) << n << ": " << msg;
  }
  EXPECT_NE(error_of(bytes + "x").find("after its end"), std::string::npos) << error_of(bytes + "x");
  std::string huge = bytes;  // the file name's length claims more bytes than there are
  const uint64_t lots = uint64_t{1} << 60;
  std::memcpy(huge.data() + 8 + 20, &lots, sizeof(lots));
  EXPECT_NE(error_of(huge).find("fit"), std::string::npos) << error_of(huge);

  // Rank 0's part: the model's rows 0 to 2 and its state's.
  RankPart first = part;
  first.file = "rank-00000.safetensors";
  first.tensors = {{"optim/w/exp_avg", "optimizer", "F32", {4, 3}}};
  first.chunks = {{"model/w", 0, 2, {}, 4096, 4120, 4096, {5u}}, {"optim/w/exp_avg", 0, 2, {}, 4120, 4144, 4096, {6u}}};
  checkpoint::detail::ManifestHeader h;
  h.name = "step-000007";
  h.step = 7;
  h.world_size = 2;
  h.block_bytes = 1 << 20;
  h.optimizer = {{"type", "AdamW"}, {"param_groups", nlohmann::ordered_json::array()}};
  int64_t total = 0, total_json = 0;
  const std::string text = checkpoint::detail::assemble_manifest(h, {{"model/w", "parameter", "F32", {4, 3}}},
                                                                 {first, RankPart::decode(bytes, 1)}, total);
  auto as_json = [](const RankPart& p) {
    nlohmann::ordered_json j = {{"file", p.file}, {"bytes", p.file_bytes}};
    j["tensors"] = nlohmann::ordered_json::object();
    for (const auto& t : p.tensors) j["tensors"][t.key] = {{"kind", t.kind}, {"dtype", t.dtype}, {"shape", t.shape}};
    j["steps"] = nlohmann::ordered_json::object();
    for (const auto& [n, s] : p.steps) j["steps"][n] = s;
    j["chunks"] = nlohmann::ordered_json::array();
    for (const auto& c : p.chunks) {
      j["chunks"].push_back({{"tensor", c.tensor},
                             {"rows", {c.row_begin, c.row_end}},
                             {"bytes", {c.begin, c.end}},
                             {"block_bytes", c.block_bytes},
                             {"crc32c", c.crc32c}});
    }
    return j.dump();
  };
  const nlohmann::ordered_json header = {
      {"name", h.name},
      {"step", h.step},
      {"world_size", h.world_size},
      {"block_bytes", h.block_bytes},
      {"strategies", h.strategies},
      {"metadata", h.metadata},
      {"optimizer", h.optimizer},
      {"tensors", {{"model/w", {{"kind", "parameter"}, {"dtype", "F32"}, {"shape", {4, 3}}}}}}};
  EXPECT_EQ(checkpoint::manifest_from_parts(header.dump(), {as_json(first), as_json(part)}, total_json), text);
  EXPECT_EQ(total, 24 + 24 + 24 + 24 + 16);
  EXPECT_EQ(total_json, total);
  // The text is JSON a reader parses: every tensor's chunks in row order, the steps agreed.
  const auto j = nlohmann::json::parse(text);
  EXPECT_EQ(j["tensors"]["model/w"]["chunks"][1]["rows"], nlohmann::json({2, 4}));
  EXPECT_EQ(j["tensors"]["model/w"]["chunks"][1]["file"], 1);
  EXPECT_EQ(j["optimizer"]["steps"]["w"], 7);
  EXPECT_EQ(j["files"][1]["bytes"], 12345);
}

// A file written by hand: header text, then `data_bytes` bytes.
std::string raw_file(const std::string& dir, const std::string& header, size_t data_bytes, int64_t claimed = -1) {
  const std::string path = dir + "/raw.safetensors";
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  const uint64_t n = claimed >= 0 ? static_cast<uint64_t>(claimed) : header.size();
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>(n >> (8 * i)));
  f << header << std::string(data_bytes, '\x01');
  return path;
}

std::string error_reading(const std::string& path) {
  try {
    checkpoint::read_safetensors_header(path);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

TEST(ManifestPart, InnerBoxesCoverATensorOnceOrAreRefused) {
  using checkpoint::InnerBox;
  using checkpoint::detail::ChunkExtent;
  using checkpoint::detail::coverage_fault;
  // A [4, 8, 6] tensor in two parts along dimension 1 (each [0:4] and [4:8], all of dimension 2),
  // each part's rows in two chunks: held once.
  const InnerBox left{{0, 0}, {4, 6}}, right{{4, 0}, {4, 6}}, wide{{2, 0}, {6, 6}}, out{{4, 0}, {5, 6}};
  const std::vector<int64_t> shape{4, 8, 6};
  EXPECT_EQ(coverage_fault(shape, {{0, 2, &left}, {2, 4, &left}, {0, 4, &right}}), "");
  EXPECT_EQ(coverage_fault(shape, {{2, 4, &right}, {0, 4, &left}, {0, 2, &right}}), "");  // any order
  EXPECT_EQ(coverage_fault(shape, {{0, 4, nullptr}}), "");                                // whole width
  EXPECT_EQ(coverage_fault({0, 8}, {}), "");                                              // no elements
  // Each fault with its own sentence (from shapes).
  EXPECT_EQ(coverage_fault(shape, {{0, 2, &left}, {0, 4, &right}}),
            "its chunks in inner box [0:4, 0:6] cover rows up to 2 of 4 (rows missing, or written twice)");
  EXPECT_EQ(coverage_fault(shape, {{0, 4, &left}}), "its inner boxes cover 24 of the 48 elements of a row");
  EXPECT_EQ(coverage_fault(shape, {{0, 4, &left}, {0, 4, &wide}}), "its inner boxes [0:4, 0:6] and [2:8, 0:6] overlap");
  EXPECT_EQ(coverage_fault(shape, {{0, 4, &left}, {0, 4, &out}}),
            "a chunk (rows 0 to 4, inner [4:9, 0:6]) lies outside the tensor: dimension 1 outside its extent 8");
  const InnerBox flat{{0}, {8}};
  EXPECT_EQ(
      coverage_fault(shape, {{0, 4, &flat}}),
      "a chunk (rows 0 to 4, inner [0:8]) lies outside the tensor: a box of 1 dimension(s) where the tensor has 2 "
      "after its rows");
  EXPECT_EQ(coverage_fault(shape, {{0, 5, &left}, {0, 4, &right}}),
            "a chunk (rows 0 to 5, inner [0:4, 0:6]) lies outside the tensor: rows outside the tensor's 4 (or none)");
  // A part's box crosses the binary part and the JSON part alike.
  checkpoint::detail::RankPart part;
  part.file = "rank-00000.safetensors";
  part.chunks = {{"model/w", 0, 4, right, 0, 384, 4096, {7u}}};
  const auto back = checkpoint::detail::RankPart::decode(part.encode(), 0);
  EXPECT_TRUE(back.chunks[0].inner == right);
  const auto json = checkpoint::detail::RankPart::from_json(nlohmann::ordered_json::parse(
      R"({"file": "f", "bytes": 1, "tensors": {}, "steps": {}, "chunks": [{"tensor": "model/w", "rows": [0, 4],
          "inner": [[4, 4], [0, 6]], "bytes": [0, 384], "block_bytes": 4096, "crc32c": [7]}]})"));
  EXPECT_TRUE(json.chunks[0].inner == right);
}

TEST(Safetensors, BrokenFilesAreRefusedEachWithItsReason) {
  TempDir tmp;
  const std::string& dir = tmp.path;
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_EQ(error_reading(raw_file(dir, ok, 8)), "no error");
  struct Case {
    std::string header;
    size_t data;
    int64_t claimed;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {ok, 7, -1, "it is truncated"},                         // truncated data
      {ok, 9, -1, "longer than its header says"},             // trailing bytes
      {ok, 8, 1 << 20, "says its header has 1048576 bytes"},  // length field beyond the file
      {"{not json", 0, -1, "is not valid JSON"},              //
      {R"({"a":{"dtype":"X9","shape":[2],"data_offsets":[0,8]}})", 8, -1, "has dtype 'X9'"},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, -1, "do not hold its shape [3]"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8, -1, "starts at byte"},  // a hole
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       8, -1, "starts at byte"},  // an overlap
      {R"({"a":{"dtype":"F32","shape":[2]}})", 8, -1, "is not a safetensors header"},
  };
  for (const auto& c : cases) {
    const std::string msg = error_reading(raw_file(dir, c.header, c.data, c.claimed));
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.header << " -> " << msg;
    EXPECT_NE(msg.find("raw.safetensors"), std::string::npos) << "names the file: " << msg;
  }
}

TEST(Safetensors, WriterRefusesWhatItCannotWrite) {
  TempDir tmp;
  const std::string& dir = tmp.path;
  auto err = [&](const std::vector<std::pair<std::string, torch::Tensor>>& t) -> std::string {
    try {
      checkpoint::write_safetensors(dir + "/x.safetensors", t);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  EXPECT_NE(err({{"a", torch::zeros({1})}, {"a", torch::zeros({1})}}).find("given twice"), std::string::npos);
  EXPECT_NE(err({{"__metadata__", torch::zeros({1})}}).find("reserved"), std::string::npos);
  EXPECT_NE(err({{"c", torch::zeros({2}, torch::kComplexFloat)}}).find("has no safetensors name"), std::string::npos);
  try {
    checkpoint::write_safetensors(dir + "/no-such-dir/x.safetensors", {{"a", torch::zeros({1})}});
    ADD_FAILURE() << "wrote into a missing directory";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("cannot create '" + dir + "/no-such-dir/x.safetensors'"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST(Safetensors, PythonReadsOursAndWeReadPythons) {
#ifndef FSDP_PYTHON
  GTEST_SKIP() << "no Python virtualenv configured";
#else
  TempDir tmp;
  const std::string& dir = tmp.path;
  const std::string ours = dir + "/ours.safetensors", theirs = dir + "/theirs.safetensors";
  const auto tensors = sample_tensors();
  checkpoint::write_safetensors(ours, tensors, {{"rank", "0"}});
  const std::string cmd = std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR + "/tests/checkpoint/check_safetensors_in_python.py " +
                          ours + " " + theirs + " > " + dir + "/python.log 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream log(dir + "/python.log");
  const std::string out((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  ASSERT_EQ(rc, 0) << out;
  for (const auto& [name, t] : tensors) EXPECT_NE(out.find(name + " torch."), std::string::npos) << out;
  const auto rec = checkpoint::read_safetensors_header(theirs);
  EXPECT_EQ(rec.metadata.at("rank"), "0");
  ASSERT_EQ(rec.tensors.size(), tensors.size());
  for (const auto& r : rec.tensors) {
    const auto it = std::find_if(tensors.begin(), tensors.end(), [&](const auto& kv) { return kv.first == r.name; });
    ASSERT_NE(it, tensors.end()) << r.name;
    EXPECT_TRUE(same_bytes(checkpoint::read_tensor(theirs, r), it->second)) << r.name;
  }
#endif
}

}  // namespace
}  // namespace fsdp::testing
