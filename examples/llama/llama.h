// A Llama in C++ (Hugging Face's LlamaForCausalLM, its parameter names and its arithmetic):
// RMSNorm, rotary embeddings in the "rotate half" convention, grouped-query attention, a SwiGLU
// MLP, a tied or untied head. Built of fsdp::tp layers, so the same model runs at every
// tensor-parallel size (a one-rank group is plain LibTorch); each decoder layer is an fsdp::Sharded
// unit. Names: model.embed_tokens.weight, model.layers.N.self_attn.{q,k,v,o}_proj.weight,
// model.layers.N.mlp.{gate,up,down}_proj.weight, model.layers.N.{input,post_attention}_layernorm.
// weight, model.norm.weight, lm_head.weight (absent when tied).
//
// A pipeline stage (fsdp::pp::LayerRange) builds only its layers, under their global names (layer
// 7 is model.layers.7 on whichever rank holds it), the embedding on the first stage and the final
// norm and head on the last (a tied head: the embedding's weight, on the last stage too). Every
// weight is drawn from a generator seeded by (seed, its name) (fsdp::pp::parameter_generator), so
// a stage's weights are those of the same layers in the whole model. Each layer initializes itself
// as it is built, so inside an fsdp::ShardingScope (train_llama --build-sharded) each is sharded
// with its weights drawn, and the model, or a stage, never exists whole on a rank.
//
// Per decoder layer the tensor-parallel collectives are Megatron's four: one all-reduce forward
// after o_proj and one after down_proj, and backward one for the attention's input gradient (q, k
// and v share one conjugate) and one for the MLP's (gate and up share one), each of B x T x C.
// With sequence parallelism (Config::sequence_parallel) each becomes an all-gather and a
// reduce-scatter (2 + 2 forward, 2 + 2 backward, of B x T x C each), plus one all-reduce backward
// of each norm's weight gradient (C elements): 10 per layer.
#pragma once

#include "fsdp/sharded.h"
#include "pp/init.h"
#include "pp/stage_split.h"
#include "programs/flops.h"
#include "tp/conjugates.h"
#include "tp/cross_entropy.h"
#include "tp/embedding.h"
#include "tp/linear.h"

#include <ATen/ops/rms_norm.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/moduledict.h>

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace llama {

struct Config {
  int64_t vocab_size = 256;  // bytes, for the example's corpus
  int64_t block_size = 64;   // the longest sequence
  int64_t n_layer = 2;
  int64_t n_head = 4;
  int64_t n_kv_head = 0;  // grouped-query attention's key-value heads; 0: n_head
  int64_t n_embd = 128;
  int64_t intermediate = 0;  // the MLP's width; 0: 4 x n_embd
  int64_t head_dim = 0;      // 0: n_embd / n_head
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-5;
  bool tie_word_embeddings = false;
  int64_t checkpoint_every = 0;  // activation checkpointing of every k-th decoder layer (0: none)
  /// Sequence parallelism: between the tensor-parallel regions (the norms, the residual stream)
  /// each rank holds block_size / tp positions; the regions' all-reduces become all-gathers and
  /// reduce-scatters.
  bool sequence_parallel = false;
  /// The arithmetic as the model computed it before its fused kernels: RMSNorm in seven kernels as
  /// transformers writes it, the rotary tables built on the CPU in every layer's forward and copied
  /// over, the key-value heads repeated by copies for grouped-query attention. The reference
  /// Llama.SdpaMatchesReferencePath compares against, and --reference-path of train_llama.
  bool reference_path = false;

  int64_t kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int64_t ffn() const { return intermediate > 0 ? intermediate : 4 * n_embd; }
  int64_t hd() const { return head_dim > 0 ? head_dim : n_embd / n_head; }
};

/// What the model's shape must satisfy at tensor-parallel size `tp`, as one message ("" if it
/// does): heads and key-value heads divisible by tp (each rank computes whole heads), query heads a
/// multiple of key-value heads, the MLP's width and the vocabulary divisible by tp.
inline std::string shape_error(const Config& c, int64_t tp) {
  const int64_t kv = c.kv_heads();
  if (c.head_dim == 0 && c.n_embd % c.n_head != 0) {
    return "the embedding (" + std::to_string(c.n_embd) + ") is not a multiple of the heads (" +
           std::to_string(c.n_head) + ")";
  }
  if (c.n_head % kv != 0) {
    return "the heads (" + std::to_string(c.n_head) + ") are not a multiple of the key-value heads (" +
           std::to_string(kv) + ")";
  }
  if (c.hd() % 2 != 0) return "the head dimension (" + std::to_string(c.hd()) + ") is odd: rotary embeddings pair it";
  if (c.n_head % tp != 0 || kv % tp != 0) {
    return "the " + std::to_string(c.n_head) + " heads and " + std::to_string(kv) +
           " key-value heads must both be divisible by the tensor-parallel size " + std::to_string(tp) +
           " (each rank computes whole heads)";
  }
  if (c.ffn() % tp != 0) {
    return "the MLP's width (" + std::to_string(c.ffn()) + ") is not divisible by the tensor-parallel size " +
           std::to_string(tp);
  }
  if (c.sequence_parallel && c.block_size % tp != 0) {
    return "sequence parallelism splits the sequence (" + std::to_string(c.block_size) +
           ") over the tensor-parallel size " + std::to_string(tp) + ", which does not divide it";
  }
  if (c.vocab_size % tp != 0) {
    return "the vocabulary (" + std::to_string(c.vocab_size) + ") is not divisible by the tensor-parallel size " +
           std::to_string(tp);
  }
  return "";
}

/// Hugging Face's LlamaRMSNorm: in fp32, then the weight in the input's dtype; at::rms_norm, one
/// fused kernel (computing in fp32 for a bf16 input as well; the weight's product apart when the
/// two dtypes differ, as under autocast), or with `reference` the seven kernels transformers
/// writes. Under sequence parallelism (`sp` set) it sees this rank's
/// positions only, so its weight's gradient is partial: copy_to_region on the weight sums it over
/// the group in backward.
/// A parameter of a model under its full name, with its tensor-parallel split: `split` is set
/// when its module is an fsdp::SplitModule (which says how each of its parameters is split, or
/// that it is not), unset otherwise (a norm's weight: replicated, initialized by its module).
struct SplitParameter {
  std::string name;
  torch::Tensor param;
  std::optional<fsdp::TensorSplit> split;
  /// How many parts make the whole tensor (1 unless split).
  int64_t parts() const { return split && split->split() ? split->parts : 1; }
};

/// Every parameter of `model` (its own and its submodules') with its split, in module order.
inline std::vector<SplitParameter> split_parameters(const torch::nn::Module& model) {
  std::vector<SplitParameter> out;
  auto add = [&](const std::string& path, const torch::nn::Module& m) {
    const auto* module = dynamic_cast<const fsdp::SplitModule*>(&m);
    std::map<std::string, fsdp::TensorSplit> splits;
    if (module != nullptr) {
      for (const auto& [name, how] : module->parameter_splits()) splits[name] = how;
    }
    for (const auto& p : m.named_parameters(/*recurse=*/false)) {
      SplitParameter sp{path.empty() ? p.key() : path + "." + p.key(), p.value(), std::nullopt};
      if (module != nullptr) sp.split = splits.count(p.key()) != 0U ? splits[p.key()] : fsdp::TensorSplit{};
      out.push_back(std::move(sp));
    }
  };
  add("", model);  // the model itself, without named_modules' include_self (it may not be held yet)
  for (const auto& item : model.named_modules("", /*include_self=*/false)) add(item.key(), *item.value());
  return out;
}

/// transformers' initialization (LlamaPreTrainedModel._init_weights) of `module`'s parameters
/// whose full names (`prefix` + their names in `module`) do not start with `skip`: every linear
/// and embedding weight drawn from N(0, 0.02), the norms' ones. Each weight is drawn in full from
/// its own generator (fsdp::pp::parameter_generator(seed, its full name)) and this rank keeps its
/// part (fsdp::SplitModule): the same model at every tensor-parallel and pipeline size, whichever
/// module initializes it and whenever. (The layers' own initialization is torch::nn's, N(0, 1)
/// for the embedding: as a tied head's logits, far too large to train from.)
inline void init_weights(const torch::nn::Module& module, const std::string& prefix, uint64_t seed,
                         const std::string& skip = "") {
  torch::NoGradGuard no_grad;
  for (auto& sp : split_parameters(module)) {
    const std::string name = prefix + sp.name;
    if (!sp.split || (!skip.empty() && name.rfind(skip, 0) == 0)) continue;  // a norm: its ones
    const fsdp::TensorSplit how = *sp.split;
    std::vector<int64_t> full = sp.param.sizes().vec();
    if (how.split()) full[how.dim] *= how.parts;
    auto w = torch::randn(full, fsdp::pp::parameter_generator(seed, name)) * 0.02;
    if (how.split()) w = w.narrow(how.dim, how.part * sp.param.size(how.dim), sp.param.size(how.dim));
    sp.param.copy_(w);
  }
}

struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps, std::optional<fsdp::tp::Group> sp = std::nullopt, bool reference = false)
      : eps(eps), sp(std::move(sp)), reference(reference), weight(register_parameter("weight", torch::ones({dim}))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const auto w = sp ? fsdp::tp::copy_to_region(weight, *sp) : weight;
    if (!reference && w.scalar_type() == x.scalar_type()) return at::rms_norm(x, {weight.size(0)}, w, eps);
    // Weight and input of two dtypes (autocast): transformers' product, in the promoted dtype.
    if (!reference) return w * at::rms_norm(x, {weight.size(0)}, std::nullopt, eps);
    auto h = x.to(torch::kFloat);
    h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return w * h.to(x.scalar_type());
  }
  double eps;
  std::optional<fsdp::tp::Group> sp;
  bool reference;
  torch::Tensor weight;
};
TORCH_MODULE(RMSNorm);

/// The rotary tables for positions [0, T): cos and sin of [T, head_dim], as transformers computes
/// them (inverse frequencies theta^(-2i/d) in fp32, each used twice: "rotate half"), on `device`.
inline std::pair<torch::Tensor, torch::Tensor> rotary(int64_t T, int64_t hd, double theta,
                                                      const torch::Device& device = torch::kCPU) {
  const auto on = torch::TensorOptions(torch::kLong).device(device);
  auto inv_freq = 1.0 / torch::pow(theta, torch::arange(0, hd, 2, on).to(torch::kFloat) / hd);
  auto freqs = torch::outer(torch::arange(T, on).to(torch::kFloat), inv_freq);
  auto emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos(), emb.sin()};
}

/// One model's rotary tables, computed on the device once per (length, device, dtype) and shared by
/// its layers (a forward recomputed by activation checkpointing in backward reads them from the
/// autograd thread: hence the lock). Not parameters or buffers: nothing to shard, save or load.
class RotaryTables {
 public:
  RotaryTables(int64_t hd, double theta) : hd_(hd), theta_(theta) {}
  std::pair<torch::Tensor, torch::Tensor> get(int64_t T, const torch::Device& device, torch::ScalarType dtype) {
    const std::lock_guard<std::mutex> lock(mutex_);
    auto& slot = tables_[std::make_tuple(T, device.str(), dtype)];
    if (!slot.first.defined()) {
      torch::NoGradGuard no_grad;
      auto [cos, sin] = rotary(T, hd_, theta_, device);
      slot = {cos.to(dtype), sin.to(dtype)};  // in fp32, then the dtype of q and k
    }
    return slot;
  }

 private:
  int64_t hd_;
  double theta_;
  std::mutex mutex_;
  std::map<std::tuple<int64_t, std::string, torch::ScalarType>, std::pair<torch::Tensor, torch::Tensor>> tables_;
};

inline torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

struct AttentionImpl : torch::nn::Module {
  AttentionImpl(const Config& c, const fsdp::tp::Group& g, std::shared_ptr<RotaryTables> rope)
      : group(g),
        sp(c.sequence_parallel),
        reference(c.reference_path),
        rope(std::move(rope)),
        heads(c.n_head / g.size()),
        kv_heads(c.kv_heads() / g.size()),
        hd(c.hd()),
        theta(c.rope_theta),
        q_proj(register_module("q_proj", column(g, c.n_embd, c.n_head * c.hd()))),
        k_proj(register_module("k_proj", column(g, c.n_embd, c.kv_heads() * c.hd()))),
        v_proj(register_module("v_proj", column(g, c.n_embd, c.kv_heads() * c.hd()))),
        o_proj(register_module("o_proj", fsdp::tp::RowParallelLinear(g, row_options(c.n_head * c.hd(), c)))) {}

  static fsdp::tp::RowParallelLinearOptions row_options(int64_t in, const Config& c) {
    return fsdp::tp::RowParallelLinearOptions(in, c.n_embd).bias(false).sequence_parallel(c.sequence_parallel);
  }
  /// The conjugate before the column-parallel layers that share `x`: copy_to_region, or under
  /// sequence parallelism the all-gather of the sequence (reduce-scatter backward).
  static torch::Tensor enter(const torch::Tensor& x, const fsdp::tp::Group& g, bool sp) {
    return sp ? fsdp::tp::gather_from_sequence_region(x, g, 1) : fsdp::tp::copy_to_region(x, g);
  }

  static fsdp::tp::ColumnParallelLinear column(const fsdp::tp::Group& g, int64_t in, int64_t out) {
    return fsdp::tp::ColumnParallelLinear(
        g, fsdp::tp::ColumnParallelLinearOptions(in, out).bias(false).conjugate_input(false));
  }

  torch::Tensor forward(const torch::Tensor& x) {
    auto in = enter(x, group, sp);  // one conjugate for q, k and v: [B, T, C]
    const int64_t B = in.size(0), T = in.size(1);
    auto q = q_proj(in).view({B, T, heads, hd}).transpose(1, 2);
    auto k = k_proj(in).view({B, T, kv_heads, hd}).transpose(1, 2);
    auto v = v_proj(in).view({B, T, kv_heads, hd}).transpose(1, 2);
    torch::Tensor cos, sin;
    if (reference) {
      std::tie(cos, sin) = rotary(T, hd, theta);
      cos = cos.to(q.device(), q.scalar_type());  // the tables in fp32, then on q's device and dtype
      sin = sin.to(q.device(), q.scalar_type());
    } else {
      std::tie(cos, sin) = rope->get(T, q.device(), q.scalar_type());
    }
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    // Grouped-query attention: each key-value head serves heads / kv_heads consecutive query heads
    // (transformers' repeat_kv); this rank's heads use this rank's key-value heads. SDPA's
    // enable_gqa reads them in place where a fused kernel takes it: flash on a GPU in fp16 or
    // bf16. Elsewhere (fp32, the CPU) the fused kernels refuse it and SDPA would fall back to its
    // math path, B x H x T x T: the heads are repeated by copies first, as the reference does.
    const int64_t rep = heads / kv_heads;
    const bool gqa_in_place = rep > 1 && !reference && q.is_cuda() &&
                              (q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kHalf);
    if (rep > 1 && !gqa_in_place) {
      k = k.unsqueeze(2).expand({B, kv_heads, rep, T, hd}).reshape({B, heads, T, hd});
      v = v.unsqueeze(2).expand({B, kv_heads, rep, T, hd}).reshape({B, heads, T, hd});
    }
    auto y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, /*scale=*/std::nullopt,
                                              /*enable_gqa=*/gqa_in_place);
    return o_proj(y.transpose(1, 2).reshape({B, T, heads * hd}));
  }

  fsdp::tp::Group group;
  bool sp, reference;
  std::shared_ptr<RotaryTables> rope;
  int64_t heads, kv_heads, hd;
  double theta;
  fsdp::tp::ColumnParallelLinear q_proj, k_proj, v_proj;
  fsdp::tp::RowParallelLinear o_proj;
};
TORCH_MODULE(Attention);

/// SwiGLU: down(silu(gate(x)) * up(x)); gate and up share one conjugate.
struct MLPImpl : torch::nn::Module {
  MLPImpl(const Config& c, const fsdp::tp::Group& g)
      : group(g),
        sp(c.sequence_parallel),
        gate_proj(register_module("gate_proj", AttentionImpl::column(g, c.n_embd, c.ffn()))),
        up_proj(register_module("up_proj", AttentionImpl::column(g, c.n_embd, c.ffn()))),
        down_proj(
            register_module("down_proj", fsdp::tp::RowParallelLinear(g, AttentionImpl::row_options(c.ffn(), c)))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto in = AttentionImpl::enter(x, group, sp);
    return down_proj(torch::silu(gate_proj(in)) * up_proj(in));
  }
  fsdp::tp::Group group;
  bool sp;
  fsdp::tp::ColumnParallelLinear gate_proj, up_proj;
  fsdp::tp::RowParallelLinear down_proj;
};
TORCH_MODULE(MLP);

/// Decoder layer `index` initializes its own weights (init_weights, from `init_seed` and its full
/// names model.layers.N.…) in its constructor: inside an fsdp::ShardingScope the fsdp::Sharded
/// layer is sharded as soon as this constructor returns, so nothing after it could.
struct DecoderLayerImpl : torch::nn::Module {
  DecoderLayerImpl(const Config& c, const fsdp::tp::Group& g, std::shared_ptr<RotaryTables> rope, int64_t index,
                   uint64_t init_seed)
      : self_attn(register_module("self_attn", Attention(c, g, std::move(rope)))),
        mlp(register_module("mlp", MLP(c, g))),
        input_layernorm(register_module("input_layernorm", norm(c, g))),
        post_attention_layernorm(register_module("post_attention_layernorm", norm(c, g))) {
    init_weights(*this, "model.layers." + std::to_string(index) + ".", init_seed);
  }
  static RMSNorm norm(const Config& c, const fsdp::tp::Group& g) {
    return RMSNorm(c.n_embd, c.rms_norm_eps, sp_group(c, g), c.reference_path);
  }
  static std::optional<fsdp::tp::Group> sp_group(const Config& c, const fsdp::tp::Group& g) {
    return c.sequence_parallel ? std::optional<fsdp::tp::Group>(g) : std::nullopt;
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x + self_attn(input_layernorm(x));
    return h + mlp(post_attention_layernorm(h));
  }
  Attention self_attn;
  MLP mlp;
  RMSNorm input_layernorm, post_attention_layernorm;
};

/// The decoder stack of `range`: the embedding if it is the first stage (or the last with a tied
/// head), its layers under their global indices (a ModuleDict keyed "7", not a ModuleList that
/// would renumber them from 0), the final norm if it is the last.
struct LlamaModelImpl : torch::nn::Module {
  LlamaModelImpl(const Config& c, const fsdp::tp::Group& blocks, const fsdp::tp::Group& vocab,
                 const fsdp::pp::LayerRange& range, uint64_t init_seed)
      : range(range), rope(std::make_shared<RotaryTables>(c.hd(), c.rope_theta)) {
    if (range.first() || (range.last() && c.tie_word_embeddings)) {
      embed_tokens = register_module(
          "embed_tokens",
          fsdp::tp::VocabParallelEmbedding(
              vocab,
              fsdp::tp::VocabParallelEmbeddingOptions(c.vocab_size, c.n_embd).sequence_parallel(c.sequence_parallel)));
    }
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> by_index;
    for (int64_t i = range.begin; i < range.end; ++i) {
      fsdp::Sharded<DecoderLayerImpl> layer(c, blocks, rope, i, init_seed);
      if (c.checkpoint_every > 0 && (i + 1) % c.checkpoint_every == 0) layer->set_activation_checkpointing(true);
      by_index.emplace_back(std::to_string(i), layer.ptr());
      unit.push_back(layer);
    }
    layers = register_module("layers", torch::nn::ModuleDict(by_index));
    if (range.last()) norm = register_module("norm", DecoderLayerImpl::norm(c, vocab));
  }
  /// The first stage takes token ids, the others the previous stage's hidden states; the last
  /// returns the normed hidden states, the others their layers' output.
  torch::Tensor forward(const torch::Tensor& in) {
    auto h = range.first() ? embed_tokens(in) : in;
    for (auto& l : unit) h = l(h);
    return range.last() ? norm(h) : h;
  }
  fsdp::pp::LayerRange range;
  fsdp::tp::VocabParallelEmbedding embed_tokens{nullptr};
  torch::nn::ModuleDict layers{nullptr};
  std::vector<fsdp::Sharded<DecoderLayerImpl>> unit;  // the same modules as `layers`, typed, in order
  RMSNorm norm{nullptr};
  std::shared_ptr<RotaryTables> rope;  // the layers' one set of tables
};
TORCH_MODULE(LlamaModel);

/// LlamaForCausalLM. forward(ids) returns this rank's vocabulary columns of the logits, [B, T, V /
/// tp]; loss(ids, targets) the mean cross-entropy without full logits on any rank. With a `range`
/// of a pipeline's stages, the model of that stage: forward takes ids on the first stage (hidden
/// states on the others) and returns logits on the last (hidden states on the others); loss is the
/// last stage's. Weights: a seed drawn from LibTorch's generator (torch::manual_seed before the
/// constructor fixes it) before any layer is built, then each weight from (seed, its name).
struct LlamaForCausalLMImpl : torch::nn::Module {
  LlamaForCausalLMImpl(const Config& c, const fsdp::tp::Group& blocks, const fsdp::tp::Group& vocab,
                       const std::optional<fsdp::pp::LayerRange>& range = std::nullopt)
      : config(checked(c, blocks.size(), range)),
        init_seed(fsdp::pp::draw_seed()),
        vocab(vocab),
        model(register_module(
            "model", LlamaModel(c, blocks, vocab, range.value_or(fsdp::pp::whole_model(c.n_layer)), init_seed))) {
    if (!c.tie_word_embeddings && model->range.last()) {
      lm_head = register_module(
          "lm_head", fsdp::tp::ColumnParallelLinear(vocab, fsdp::tp::ColumnParallelLinearOptions(c.n_embd, c.vocab_size)
                                                               .bias(false)
                                                               .sequence_parallel(c.sequence_parallel)));
    }
    // The embedding, the head (the layers initialized themselves, each as it was built).
    init_weights(*this, "", init_seed, /*skip=*/"model.layers.");
  }
  /// `c`, or std::invalid_argument with shape_error's message (or a range outside the layers):
  /// before any layer is built.
  static const Config& checked(const Config& c, int64_t tp, const std::optional<fsdp::pp::LayerRange>& range) {
    const std::string err = shape_error(c, tp);
    if (!err.empty()) throw std::invalid_argument("llama: " + err);
    if (range && (range->begin < 0 || range->end > c.n_layer || range->size() < 1)) {
      throw std::invalid_argument("llama: " + range->text() + " is not a run of the model's " +
                                  std::to_string(c.n_layer) + " layers");
    }
    return c;
  }
  torch::Tensor forward(const torch::Tensor& in) {
    auto h = model(in);
    if (!model->range.last()) return h;
    if (lm_head) return lm_head(h);
    // Tied: the embedding's rows are this rank's vocabulary, the head's rows too.
    return torch::linear(AttentionImpl::enter(h, vocab, config.sequence_parallel), model->embed_tokens->weight);
  }
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& targets) {
    return fsdp::tp::vocab_parallel_cross_entropy(forward(ids), targets, vocab);
  }
  Config config;
  uint64_t init_seed;  // drawn before any layer: their own initialization draws from the same generator
  fsdp::tp::Group vocab;
  LlamaModel model;
  fsdp::tp::ColumnParallelLinear lm_head{nullptr};
};
TORCH_MODULE(LlamaForCausalLM);

/// The Llama's shape as the FLOPs count takes it (programs/flops.h), for a model of `params`
/// parameters (every tensor-parallel part once): the token embedding is a lookup, the head (tied or
/// not) counts.
inline fsdp::programs::TransformerShape flops_shape(const Config& c, int64_t params) {
  return {params, c.tie_word_embeddings ? 0 : c.vocab_size * c.n_embd, c.n_layer, c.n_head, c.hd()};
}

}  // namespace llama
