// The Llama as pipeline stages (fsdp::pp): this rank's stages built from a layout and a split of
// the layers, their parameters, the tied embedding's gradient summed over the first and last
// stage, and the global gradient norm over the pipeline and the tensor-parallel ranks. What
// train_llama --pp runs, and what tests/pp/test_pipeline.cpp holds against one process.
#pragma once

#include "examples/llama/llama.h"
#include "fsdp/device_mesh.h"
#include "fsdp/fully_shard.h"
#include "fsdp/process_group.h"
#include "fsdp/sharding_scope.h"
#include "pp/pipeline.h"
#include "pp/stage_layout.h"
#include "pp/stage_split.h"

#include <torch/torch.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

namespace llama {

/// How PipelinedLlama builds each stage sharded: inside an fsdp::ShardingScope over the stage's
/// own ranks (fsdp::pp::stage_mesh), with these options, so that each decoder layer is sharded as
/// soon as it is built, then the stage wrapped by fsdp::fully_shard(model, scope).
struct ShardAsBuilt {
  fsdp::DeviceMesh stage_mesh;
  fsdp::FullyShardOptions options;
};

/// This pipeline rank's stages of one Llama.
struct PipelinedLlama {
  /// Builds the stages `layout` gives pipeline rank `pp_rank`, the layers split uniformly (the
  /// embedding and the head weighed as layers). torch::manual_seed(seed) before each, so that each
  /// stage draws the whole model's seed (fsdp::pp::draw_seed) and its weights are the whole
  /// model's. With `shard_as_built` each stage is built sharded (`sharded`: their handles): a
  /// stage's layers never exist whole on a rank together, only its root's embedding, final norm
  /// and head do until it is wrapped.
  PipelinedLlama(const Config& c, const fsdp::tp::Group& blocks, const fsdp::tp::Group& vocab,
                 const fsdp::pp::StageLayout& layout, int64_t pp_rank, uint64_t seed,
                 const std::optional<ShardAsBuilt>& shard_as_built = std::nullopt)
      : config(c),
        vocab(vocab),
        instance(next_instance()),
        ranges(fsdp::pp::StageSplit::uniform(c.n_layer).split(layout.stages())) {
    for (const int64_t s : layout.stages_of(pp_rank)) {
      torch::manual_seed(seed);
      std::optional<fsdp::ShardingScope> scope;
      if (shard_as_built) scope.emplace(shard_as_built->stage_mesh, shard_as_built->options);
      models.emplace_back(c, blocks, vocab, ranges[static_cast<size_t>(s)]);
      if (scope) sharded.push_back(fsdp::fully_shard(models.back(), *scope));
      indices.push_back(s);
    }
  }

  std::vector<torch::Tensor> parameters() const {
    std::vector<torch::Tensor> all;
    for (const auto& m : models) {
      for (const auto& p : m->parameters()) all.push_back(p);
    }
    return all;
  }

  /// The whole model's parameters these stages hold: a tensor-parallel part counted as its whole
  /// tensor, a tied head's copy of the embedding not again. Before the stages are wrapped, or
  /// built sharded (whose parameters are this rank's shards: their shard specs give the shapes).
  int64_t whole_parameters() const {
    int64_t n = 0;
    const torch::Tensor skip = tied_copy();
    for (size_t i = 0; i < models.size(); ++i) {
      if (sharded.empty()) {
        for (const auto& sp : split_parameters(*models[i])) {
          if (!(skip.defined() && sp.param.is_same(skip))) n += sp.param.numel() * sp.parts();
        }
        continue;
      }
      const auto& range = models[i]->model->range;
      const bool copy = config.tie_word_embeddings && range.last() && !range.first();
      for (const auto& s : sharded[i].shard_specs()) {
        if (copy && s.name == "model.embed_tokens.weight") continue;
        int64_t e = s.tp.split() ? s.tp.parts : 1;
        for (const int64_t d : s.global_shape) e *= d;
        n += e;
      }
    }
    return n;
  }

  /// The stages as fsdp::pp::Pipeline runs them (the last stage's output: its logits).
  std::vector<fsdp::pp::Stage> stages() const {
    std::vector<fsdp::pp::Stage> out;
    for (size_t i = 0; i < models.size(); ++i) {
      LlamaForCausalLM m = models[i];
      out.push_back({indices[i], [m](const torch::Tensor& x) mutable { return m->forward(x); }, m->parameters()});
    }
    return out;
  }

  /// A tied head's copy of the embedding on the last stage (undefined elsewhere, and when the
  /// first and last stage are one).
  torch::Tensor tied_copy() const {
    for (const auto& m : models) {
      if (config.tie_word_embeddings && m->model->range.last() && !m->model->range.first()) {
        return m->model->embed_tokens->weight;
      }
    }
    return {};
  }
  torch::Tensor first_embedding() const {
    for (const auto& m : models) {
      if (m->model->range.first()) return m->model->embed_tokens->weight;
    }
    return {};
  }

  /// Tied embedding and head on the first and last stage: each copy's gradient becomes their sum,
  /// so that the two stay one value (one process's gradient of the one weight). Every rank calls
  /// it; the ranks of the first and last stage at one (dp, tp) place sum over a group of the two
  /// (made at the first call), the others do nothing. With FSDP inside the stages each copy is
  /// this rank's shard, the same rows in both stages.
  void sum_tied_gradients(const fsdp::DeviceMesh& mesh) {
    const int P = mesh.size(fsdp::kPipeDim);
    if (!config.tie_word_embeddings || P == 1) return;
    const int per_stage = mesh.world_size() / P, place = mesh.rank() % per_stage;
    const int first = place, last = (P - 1) * per_stage + place;
    if (mesh.rank() != first && mesh.rank() != last) return;
    if (!tied_group) {
      tied_group = fsdp::new_subgroup(mesh.world(), {first, last},
                                      "llama-tied-" + std::to_string(instance) + "-" + std::to_string(place));
    }
    const torch::Tensor w = first_embedding().defined() ? first_embedding() : tied_copy();
    torch::Tensor g = w.grad().defined() ? w.grad().clone() : torch::zeros_like(w);
    fsdp::all_reduce(tied_group, g);
    if (w.grad().defined()) {
      w.grad().copy_(g);  // in place: with FSDP the gradient is a view of the unit's flat gradient
    } else {
      w.mutable_grad() = g;
    }
  }

  /// The global L2 norm of the gradients over the pipeline's stages and the tensor-parallel
  /// ranks: a tensor-parallel part counted on its rank, a replicated tensor (the norms) once, the
  /// tied head's copy not at all (it is the embedding). One all-reduce over the world (pp x tp).
  double grad_norm(const fsdp::DeviceMesh& mesh) const {
    double sq = 0;
    const torch::Tensor skip = tied_copy();
    for (const auto& m : models) {
      for (const auto& sp : split_parameters(*m)) {
        const torch::Tensor& g = sp.param.grad();
        if (!g.defined() || (skip.defined() && sp.param.is_same(skip))) continue;
        if (sp.parts() > 1 || vocab.rank() == 0) sq += g.to(torch::kDouble).pow(2).sum().item<double>();
      }
    }
    auto t = torch::tensor({sq}, torch::kDouble);
    fsdp::all_reduce(mesh.world(), t);
    return std::sqrt(t.item<double>());
  }

  /// torch's clip_grad_norm_ over the whole pipeline: every gradient scaled by max / (norm + 1e-6)
  /// when the norm exceeds `max_norm`; returns the norm before clipping.
  double clip_grad_norm(const fsdp::DeviceMesh& mesh, double max_norm) const {
    const double norm = grad_norm(mesh);
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1) {
      torch::NoGradGuard no_grad;
      for (const auto& p : parameters()) {
        if (p.grad().defined()) p.grad().mul_(coef);
      }
    }
    return norm;
  }

  Config config;
  fsdp::tp::Group vocab;
  /// Every rank builds its PipelinedLlamas in the same order: the count names their subgroups alike.
  static int64_t next_instance() {
    static int64_t made = 0;
    return made++;
  }
  int64_t instance;
  c10::intrusive_ptr<c10d::ProcessGroup> tied_group;  // the first and last stage's ranks at one place
  std::vector<fsdp::pp::LayerRange> ranges;           // every stage's
  std::vector<LlamaForCausalLM> models;               // this rank's, in increasing stage order
  /// The same stages wrapped, when built with ShardAsBuilt (empty otherwise).
  std::vector<fsdp::FullyShardedModule<LlamaForCausalLMImpl>> sharded;
  std::vector<int64_t> indices;  // their stage indices
};

}  // namespace llama
