#include "examples/llama/hf.h"

#include "fsdp/process_group.h"
#include "fsdp/tensor_split.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <stdexcept>

namespace llama::hf {
namespace {

[[noreturn]] void refuse(const std::string& dir, const std::string& why) {
  throw fsdp::programs::UsageError("--from-hf " + dir + ": " + why, false);
}

nlohmann::json read_json(const std::string& path, const std::string& dir) {
  std::ifstream in(path);
  if (!in) refuse(dir, "cannot open " + path + " (a Hugging Face model directory has config.json)");
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    refuse(dir, path + " is not valid JSON: " + e.what());
  }
}

}  // namespace

Config read_config(const std::string& dir, int64_t block_size) {
  const nlohmann::json j = read_json(dir + "/config.json", dir);
  const auto arch = j.value("architectures", nlohmann::json::array());
  const bool llama = arch.is_array() ? std::find(arch.begin(), arch.end(), "LlamaForCausalLM") != arch.end()
                                     : j.value("model_type", "") == "llama";
  if (!llama) {
    refuse(dir, "architectures is " + arch.dump() + " (model_type '" + j.value("model_type", "") +
                    "'); the example implements LlamaForCausalLM only");
  }
  auto unsupported = [&](const std::string& key, const std::string& why) {
    refuse(dir, "config.json sets " + key + " = " + j.at(key).dump() + ", which the C++ Llama does not implement (" +
                    why + ")");
  };
  if (j.value("hidden_act", "silu") != "silu") unsupported("hidden_act", "its MLP is SwiGLU: silu only");
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) unsupported("rope_scaling", "plain rotary only");
  double theta = j.value("rope_theta", 10000.0);
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    const auto& rp = j["rope_parameters"];
    if (rp.value("rope_type", "default") != "default") unsupported("rope_parameters", "rope_type 'default' only");
    theta = rp.value("rope_theta", theta);
  }
  if (j.value("attention_bias", false)) unsupported("attention_bias", "no biases");
  if (j.value("mlp_bias", false)) unsupported("mlp_bias", "no biases");
  if (j.value("pretraining_tp", 1) != 1) unsupported("pretraining_tp", "1 only");
  Config c;
  try {
    c.vocab_size = j.at("vocab_size").get<int64_t>();
    c.n_embd = j.at("hidden_size").get<int64_t>();
    c.n_layer = j.at("num_hidden_layers").get<int64_t>();
    c.n_head = j.at("num_attention_heads").get<int64_t>();
    c.n_kv_head = j.value("num_key_value_heads", c.n_head);
    c.intermediate = j.at("intermediate_size").get<int64_t>();
    c.head_dim = j.contains("head_dim") && !j["head_dim"].is_null() ? j["head_dim"].get<int64_t>() : 0;
    c.rms_norm_eps = j.value("rms_norm_eps", 1e-6);
    c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  } catch (const std::exception& e) {
    refuse(dir, "config.json lacks a size, or has one of another type: " + std::string(e.what()));
  }
  c.rope_theta = theta;
  c.block_size = block_size;
  if (c.vocab_size < 256) {
    refuse(dir, "the vocabulary has " + std::to_string(c.vocab_size) +
                    " tokens; the example trains on a byte corpus, which needs at least 256");
  }
  if (c.n_embd < 1 || c.n_layer < 1 || c.n_head < 1 || c.n_kv_head < 1 || c.intermediate < 1 || c.head_dim < 0) {
    refuse(dir,
           "config.json has a size below 1 (vocab_size, hidden_size, num_hidden_layers, num_attention_heads, "
           "num_key_value_heads, intermediate_size, head_dim: " +
               std::to_string(c.vocab_size) + ", " + std::to_string(c.n_embd) + ", " + std::to_string(c.n_layer) +
               ", " + std::to_string(c.n_head) + ", " + std::to_string(c.n_kv_head) + ", " +
               std::to_string(c.intermediate) + ", " + std::to_string(c.head_dim) + ")");
  }
  return c;
}

namespace {
std::vector<fsdp::checkpoint::TensorRecord> whole_tensors(const Config& c);
}  // namespace

void load_weights(const std::string& dir, torch::nn::Module& model, const Config* stage_of) {
  namespace ck = fsdp::checkpoint;
  // Which file holds each tensor: the index's weight map, or the one file.
  std::map<std::string, std::string> file_of;
  const std::string index = dir + "/model.safetensors.index.json";
  std::map<std::string, ck::FileRecord> headers;
  auto header = [&](const std::string& file) -> const ck::FileRecord& {
    auto it = headers.find(file);
    if (it == headers.end()) it = headers.emplace(file, ck::read_safetensors_header(dir + "/" + file)).first;
    return it->second;
  };
  if (std::filesystem::exists(index)) {
    const nlohmann::json map = read_json(index, dir);  // named: items() iterates into it
    if (!map.contains("weight_map") || !map["weight_map"].is_object()) refuse(dir, index + " has no weight_map");
    for (const auto& [name, file] : map["weight_map"].items()) file_of[name] = file.get<std::string>();
  } else {
    if (!std::filesystem::exists(dir + "/model.safetensors")) refuse(dir, "has neither model.safetensors nor " + index);
    for (const auto& t : header("model.safetensors").tensors) file_of[t.name] = "model.safetensors";
  }
  torch::NoGradGuard no_grad;
  std::set<std::string> used;
  // Tensor `name` in the files, of the whole shape `full`: its file's header and its record, or a
  // refusal naming it and the file.
  auto stored = [&](const std::string& name,
                    const std::vector<int64_t>& full) -> std::pair<const ck::FileRecord*, const ck::TensorRecord*> {
    const auto f = file_of.find(name);
    if (f == file_of.end()) refuse(dir, "no tensor '" + name + "' in its weights (is config.json this model's?)");
    used.insert(name);
    const ck::FileRecord& rec = header(f->second);
    const auto t =
        std::find_if(rec.tensors.begin(), rec.tensors.end(), [&](const ck::TensorRecord& r) { return r.name == name; });
    if (t == rec.tensors.end()) {
      refuse(dir, f->second + " has no tensor '" + name + "', which the index says it holds");
    }
    if (t->shape != full) {
      refuse(dir, "tensor '" + name + "' in " + f->second + " has shape " + c10::str(c10::IntArrayRef(t->shape)) +
                      ", the model's is " + c10::str(c10::IntArrayRef(full)) + " (is config.json this file's?)");
    }
    return {&rec, &*t};
  };
  // A stage: the whole model's tensors checked first, so that every stage's ranks refuse the same
  // files alike (one stage refusing alone would leave the others waiting in their first transfer);
  // the other stages' tensors are theirs, not unused.
  if (stage_of != nullptr) {
    for (const auto& want : whole_tensors(*stage_of)) stored(want.name, want.shape);
  }
  for (auto& sp : split_parameters(model)) {
    const std::string& name = sp.name;
    at::Tensor& local = sp.param;
    const fsdp::TensorSplit how = sp.split.value_or(fsdp::TensorSplit{});
    std::vector<int64_t> full = local.sizes().vec();
    if (how.split()) full[how.dim] *= how.parts;
    const auto [rec, t] = stored(name, full);
    // This rank's part: for each index over the dimensions before the split one, one run of
    // part-size x (the elements after it); a tensor not split is one run.
    const at::ScalarType type = ck::scalar_type_of(t->dtype, rec->path);
    const int64_t es = static_cast<int64_t>(c10::elementSize(type));
    const int64_t d = how.split() ? how.dim : 0;
    int64_t outer = 1, inner = 1;
    for (int64_t i = 0; i < d; ++i) outer *= full[i];
    for (size_t i = d + 1; i < full.size(); ++i) inner *= full[i];
    const int64_t n_full = full.empty() ? 1 : full[d], n = full.empty() ? 1 : local.size(d);
    const int64_t first = how.split() ? how.part * n : 0;
    at::Tensor buf = at::empty(local.sizes(), at::TensorOptions().dtype(type));
    auto* dst = static_cast<char*>(buf.data_ptr());
    for (int64_t o = 0; o < outer; ++o) {
      const uint64_t at = t->begin + static_cast<uint64_t>(((o * n_full) + first) * inner * es);
      ck::read_bytes(rec->path, at, static_cast<uint64_t>(n * inner * es), dst + o * n * inner * es);
    }
    local.copy_(buf);
  }
  // Tensors the model has no parameter for (more layers than config.json says, another model's
  // file): loaded nothing from them, said so. A tied head's lm_head.weight, if stored, is one.
  std::vector<std::string> unused;
  for (const auto& [name, file] : file_of) {
    if (used.count(name) == 0U) unused.push_back(name);
  }
  if (!unused.empty() && (std::getenv("RANK") == nullptr || std::string(std::getenv("RANK")) == "0")) {
    std::cerr << "train_llama: warning: --from-hf " << dir << ": " << unused.size()
              << " tensor(s) the model has no parameter for were not loaded, e.g. '" << unused.front() << "'\n";
  }
}

void write_logits(const std::string& file, const at::Tensor& logits) {
  fsdp::checkpoint::write_safetensors(file, {{"logits", logits.to(at::kFloat).cpu().contiguous()}});
}

namespace {

// The whole model's tensors (Hugging Face's names, whole shapes), in the model's order: what an
// export writes, whichever ranks and stages hold them.
std::vector<fsdp::checkpoint::TensorRecord> whole_tensors(const Config& c) {
  const int64_t C = c.n_embd, V = c.vocab_size, F = c.ffn(), q = c.n_head * c.hd(), kv = c.kv_heads() * c.hd();
  std::vector<fsdp::checkpoint::TensorRecord> out{{"model.embed_tokens.weight", "F32", {V, C}}};
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string l = "model.layers." + std::to_string(i) + ".";
    for (const auto& [name, shape] :
         std::vector<std::pair<std::string, std::vector<int64_t>>>{{"self_attn.q_proj.weight", {q, C}},
                                                                   {"self_attn.k_proj.weight", {kv, C}},
                                                                   {"self_attn.v_proj.weight", {kv, C}},
                                                                   {"self_attn.o_proj.weight", {C, q}},
                                                                   {"mlp.gate_proj.weight", {F, C}},
                                                                   {"mlp.up_proj.weight", {F, C}},
                                                                   {"mlp.down_proj.weight", {C, F}},
                                                                   {"input_layernorm.weight", {C}},
                                                                   {"post_attention_layernorm.weight", {C}}}) {
      out.push_back({l + name, "F32", shape});
    }
  }
  out.push_back({"model.norm.weight", "F32", {C}});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", "F32", {V, C}});
  return out;
}

void write_config(const std::string& out, const Config& c) {
  std::filesystem::create_directories(out);
  nlohmann::json j = {{"architectures", {"LlamaForCausalLM"}},
                      {"model_type", "llama"},
                      {"vocab_size", c.vocab_size},
                      {"hidden_size", c.n_embd},
                      {"intermediate_size", c.ffn()},
                      {"num_hidden_layers", c.n_layer},
                      {"num_attention_heads", c.n_head},
                      {"num_key_value_heads", c.kv_heads()},
                      {"head_dim", c.hd()},
                      {"hidden_act", "silu"},
                      {"max_position_embeddings", c.block_size},
                      {"rms_norm_eps", c.rms_norm_eps},
                      {"rope_parameters", {{"rope_theta", c.rope_theta}, {"rope_type", "default"}}},
                      {"attention_bias", false},
                      {"mlp_bias", false},
                      {"tie_word_embeddings", c.tie_word_embeddings},
                      {"dtype", "float32"}};
  std::ofstream(out + "/config.json") << j.dump(2) << "\n";
}

}  // namespace

void export_model(const std::string& out, const fsdp::FSDPModule& model, const fsdp::DeviceMesh& mesh,
                  const Config& c) {
  export_model(out, std::vector<fsdp::FSDPModule>{model}, {{}}, mesh, c);
}

void export_model(const std::string& out, const std::vector<fsdp::FSDPModule>& models,
                  const std::vector<std::vector<std::string>>& copies, const fsdp::DeviceMesh& mesh, const Config& c) {
  const bool writer = mesh.rank() == 0;
  const auto records = whole_tensors(c);
  // This rank's rows of each tensor, by name (a tied head's copy of the embedding left out).
  std::vector<std::vector<fsdp::ShardSpec>> specs;
  std::map<std::string, const fsdp::ShardSpec*> held;
  for (const auto& m : models) specs.push_back(m.shard_specs());
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& skip = copies.at(i);
    for (const auto& s : specs[i]) {
      if (std::find(skip.begin(), skip.end(), s.name) == skip.end()) held.emplace(s.name, &s);
    }
  }
  // The stages against the config, on every rank before anything is written or exchanged: a rank
  // that threw here alone would leave the others waiting in the first all-reduce below.
  std::string wrong;
  size_t found = 0;
  for (const auto& record : records) {
    const auto it = held.find(record.name);
    if (it == held.end()) continue;
    ++found;
    const fsdp::ShardSpec& s = *it->second;
    std::vector<int64_t> shape = s.global_shape;
    if (s.tp.split()) shape[s.tp.dim] *= s.tp.parts;
    if (shape != record.shape && wrong.empty()) wrong = "'" + s.name + "' is not of the shape the config gives";
  }
  if (found != held.size() && wrong.empty()) wrong = "the model holds tensors its config does not name";
  at::Tensor bad = at::full({1}, wrong.empty() ? 0 : 1, at::kInt);
  fsdp::all_reduce(mesh.world(), bad, c10d::ReduceOp::MAX);
  if (bad.item<int>() != 0) {
    throw std::logic_error("llama::hf::export_model on global rank " + std::to_string(mesh.rank()) + ": " +
                           (wrong.empty() ? std::string("another rank's stages do not match the config") : wrong) +
                           "; nothing was written");
  }
  std::unique_ptr<fsdp::checkpoint::SafetensorsWriter> file;
  if (writer) {
    write_config(out, c);
    file = std::make_unique<fsdp::checkpoint::SafetensorsWriter>(out + "/model.safetensors", records,
                                                                 std::map<std::string, std::string>{{"format", "pt"}});
  }
  const int tp_rank = mesh.coordinate(fsdp::kTensorDim);
  for (const auto& record : records) {
    // Every element comes from exactly one rank (the first replica's rows of the stage that holds
    // the tensor; a parameter tensor parallelism does not split from tp rank 0), so the sum is exact.
    at::Tensor full = at::zeros(record.shape, at::kFloat);
    const auto it = held.find(record.name);
    if (it != held.end()) {
      const fsdp::ShardSpec& s = *it->second;
      if (s.replica_rank == 0 && (s.tp.split() || tp_rank == 0) && s.row_end > s.row_begin) {
        at::Tensor part =
            s.tp.split() ? full.narrow(s.tp.dim, s.tp.part * s.global_shape[s.tp.dim], s.global_shape[s.tp.dim]) : full;
        part.narrow(0, s.row_begin, s.row_end - s.row_begin).copy_(s.local.detach());
      }
    }
    fsdp::all_reduce(mesh.world(), full);
    if (file) file->write(full.data_ptr(), static_cast<uint64_t>(full.nbytes()));
  }
  if (file) file->finish();
}

}  // namespace llama::hf
