// A small GPT (nanoGPT's layout): token and position embeddings, N transformer blocks, a final
// LayerNorm and an untied head. GPT<true> marks each block as an fsdp::Sharded unit, and with
// Config::wrap = kTorchtitan also the token embedding and the final norm with the head (one unit
// over the two, fsdp::ShardedUnit::share_unit_with); GPT<false> is the same model in plain LibTorch
// (the reference the tests compare against). Parameter names are the same in all: wte.weight,
// h.0.attn.c_attn.weight, ..., lm_head.weight.
#pragma once

#include "fsdp/sharded.h"
#include "programs/flops.h"

#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>
#include <type_traits>
#include <vector>

namespace gpt {

/// How GPT<true> is cut into units. kBlocks: each block; the root keeps the embeddings, the final
/// norm and the head. kTorchtitan (torchtitan's parallelize_llama): the token embedding, each
/// block, and the final norm with the head are units; the root keeps the position embedding, so
/// that every unit reduces its gradients as soon as they are ready.
enum class Wrap { kBlocks, kTorchtitan };

struct Config {
  int64_t vocab_size = 256;  // bytes
  int64_t block_size = 64;
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  bool bias = true;      // biases in the blocks' Linear layers (nanoGPT's `bias`)
  double dropout = 0.0;  // on the attention weights and on each residual branch, in training (nanoGPT's)
  /// Activation checkpointing of every k-th block (k, 2k, ...; 0: none): GPT<true> sets it on the
  /// units (fsdp::ShardedUnit::set_activation_checkpointing), GPT<false> calls
  /// fsdp::activation_checkpoint itself, so both compute the same.
  int64_t checkpoint_every = 0;
  Wrap wrap = Wrap::kBlocks;  // GPT<true> only: GPT<false> has no units
  /// Attention as the GPT computed it before at::scaled_dot_product_attention (the scores, a mask,
  /// softmax, each a kernel of B x H x T x T): the reference Gpt.SdpaMatchesReferencePath compares
  /// against, and --reference-path of the examples, for a step-time comparison.
  bool reference_path = false;
};

/// A module built as Impl(args...), an fsdp::Sharded unit when `unit` (sharded as it is built inside
/// an fsdp::ShardingScope), held as an AnyModule so that one model type serves both.
template <typename Impl, typename... Args>
torch::nn::AnyModule unit_if(bool unit, Args&&... args) {
  if (unit) return torch::nn::AnyModule(fsdp::Sharded<Impl>(std::forward<Args>(args)...).ptr());
  return torch::nn::AnyModule(std::make_shared<Impl>(std::forward<Args>(args)...));
}

struct CausalSelfAttentionImpl : torch::nn::Module {
  explicit CausalSelfAttentionImpl(const Config& c)
      : n_head(c.n_head),
        dropout(c.dropout),
        reference_path(c.reference_path),
        c_attn(register_module("c_attn",
                               torch::nn::Linear(torch::nn::LinearOptions(c.n_embd, 3 * c.n_embd).bias(c.bias)))),
        c_proj(
            register_module("c_proj", torch::nn::Linear(torch::nn::LinearOptions(c.n_embd, c.n_embd).bias(c.bias)))) {}

  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hs = C / n_head;
    auto qkv = c_attn(x).split(C, 2);
    auto heads = [&](const torch::Tensor& t) { return t.view({B, T, n_head, hs}).transpose(1, 2); };
    auto q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
    if (!reference_path) {
      // One fused kernel (flash or cuDNN on a GPU, the math path's fused CPU kernel here), causal
      // without a mask tensor; dropout on the attention weights as the reference's.
      auto y = at::scaled_dot_product_attention(q, k, v, {}, is_training() ? dropout : 0.0, /*is_causal=*/true);
      return c_proj(y.transpose(1, 2).contiguous().view({B, T, C}));
    }
    auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hs)));
    auto mask = torch::ones({T, T}, torch::TensorOptions(torch::kBool).device(x.device())).tril();
    att = att.masked_fill(mask.logical_not(), -std::numeric_limits<float>::infinity()).softmax(-1);
    if (dropout > 0) att = torch::dropout(att, dropout, is_training());
    auto y = torch::matmul(att, v).transpose(1, 2).contiguous().view({B, T, C});
    return c_proj(y);
  }

  int64_t n_head;
  double dropout;
  bool reference_path;
  torch::nn::Linear c_attn, c_proj;
};
TORCH_MODULE(CausalSelfAttention);

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(const Config& c)
      : c_fc(register_module("c_fc", torch::nn::Linear(torch::nn::LinearOptions(c.n_embd, 4 * c.n_embd).bias(c.bias)))),
        c_proj(register_module("c_proj",
                               torch::nn::Linear(torch::nn::LinearOptions(4 * c.n_embd, c.n_embd).bias(c.bias)))) {}
  torch::Tensor forward(const torch::Tensor& x) { return c_proj(torch::gelu(c_fc(x), "tanh")); }
  torch::nn::Linear c_fc, c_proj;
};
TORCH_MODULE(MLP);

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const Config& c)
      : ln_1(register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})))),
        attn(register_module("attn", CausalSelfAttention(c))),
        ln_2(register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})))),
        mlp(register_module("mlp", MLP(c))),
        dropout(c.dropout) {}
  torch::Tensor forward(torch::Tensor x) {
    x = x + residual(attn(ln_1(x)));
    return x + residual(mlp(ln_2(x)));
  }
  torch::Tensor residual(const torch::Tensor& y) { return dropout > 0 ? torch::dropout(y, dropout, is_training()) : y; }
  torch::nn::LayerNorm ln_1;
  CausalSelfAttention attn;
  torch::nn::LayerNorm ln_2;
  MLP mlp;
  double dropout;
};
TORCH_MODULE(Block);

template <bool kSharded>
struct GPTImpl : torch::nn::Module {
  using BlockHolder = std::conditional_t<kSharded, fsdp::Sharded<BlockImpl>, Block>;

  explicit GPTImpl(const Config& c)
      : config(c),
        wte(registered("wte", unit_if<torch::nn::EmbeddingImpl>(titan(), c.vocab_size, c.n_embd))),
        wpe(register_module("wpe", torch::nn::Embedding(c.block_size, c.n_embd))),
        h(register_module("h", torch::nn::ModuleList())),
        ln_f(registered("ln_f", unit_if<torch::nn::LayerNormImpl>(titan(), torch::nn::LayerNormOptions({c.n_embd})))),
        lm_head(registered("lm_head", unit_if<torch::nn::LinearImpl>(
                                          titan(), torch::nn::LinearOptions(c.n_embd, c.vocab_size).bias(false)))) {
    // FSDP2's fully_shard([norm, output]): the head's unit is the final norm's, names unchanged.
    if (titan()) fsdp::as_unit(lm_head.ptr()).share_unit_with(fsdp::as_unit(ln_f.ptr()));
    for (int64_t i = 0; i < c.n_layer; ++i) {
      blocks.emplace_back(c);
      h->push_back(blocks.back().ptr());  // registered as h.<i>; called through `blocks`
      if constexpr (kSharded) {
        if (checkpointed(i)) blocks.back()->set_activation_checkpointing(true);
      }
    }
  }
  torch::nn::AnyModule registered(const std::string& name, torch::nn::AnyModule m) {
    register_module(name, m.ptr());
    return m;
  }
  bool titan() const { return kSharded && config.wrap == Wrap::kTorchtitan; }
  bool checkpointed(int64_t block) const {
    return config.checkpoint_every > 0 && (block + 1) % config.checkpoint_every == 0;
  }

  /// idx: [B, T] token ids -> logits [B, T, vocab]
  torch::Tensor forward(const torch::Tensor& idx) {
    const int64_t T = idx.size(1);
    auto x = wte.forward(idx) + wpe(torch::arange(T, idx.options()));
    for (size_t i = 0; i < blocks.size(); ++i) {
      auto& b = blocks[i];
      if constexpr (!kSharded) {
        if (checkpointed(static_cast<int64_t>(i)) && is_training()) {
          x = fsdp::activation_checkpoint([b](const torch::Tensor& in) mutable { return b(in); }, x);
          continue;
        }
      }
      x = b(x);
    }
    return lm_head.forward(ln_f.forward(x));
  }

  Config config;
  torch::nn::AnyModule wte;  // Embedding
  torch::nn::Embedding wpe;
  torch::nn::ModuleList h;
  std::vector<BlockHolder> blocks;
  torch::nn::AnyModule ln_f, lm_head;  // LayerNorm, Linear
};

template <bool kSharded>
std::shared_ptr<GPTImpl<kSharded>> make_gpt(const Config& c) {
  return std::make_shared<GPTImpl<kSharded>>(c);
}

/// The GPT's shape as the FLOPs count takes it (programs/flops.h), for a model of `params`
/// parameters: both embeddings are lookups, the untied head counts.
inline fsdp::programs::TransformerShape flops_shape(const Config& c, int64_t params) {
  return {params, (c.vocab_size + c.block_size) * c.n_embd, c.n_layer, c.n_head, c.n_embd / c.n_head};
}

/// The same, moved to `device` (built on the CPU from the current seed, so the same weights on any device).
template <bool kSharded>
std::shared_ptr<GPTImpl<kSharded>> make_gpt_on(const Config& c, const torch::Device& device) {
  auto net = make_gpt<kSharded>(c);
  net->to(device);
  return net;
}

}  // namespace gpt
