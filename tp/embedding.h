// A vocabulary-parallel embedding (Megatron-LM's VocabParallelEmbedding): the [V, C] table split
// by rows over the T ranks of a tensor-parallel group, rank r holding tokens [r V/T, (r + 1) V/T).
//
//   fsdp::tp::VocabParallelEmbedding wte(tp, fsdp::tp::VocabParallelEmbeddingOptions(V, C));
//   auto h = wte(ids);   // [B, S] -> [B, S, C] on every rank
//
// Each rank looks up the tokens it holds (zeros for the others) and the all-reduce of the ranks'
// rows is the embedding: one all-reduce of [B, S, C] forward, none backward (each rank's
// gradient reaches its own rows only). Initial values as torch::nn::Embedding(V, C)'s, drawn in
// full from the current random stream and this rank's rows kept, so a seed gives one model at
// every tensor-parallel size; the parameter is named "weight".
#pragma once

#include "fsdp/export.h"
#include "fsdp/tensor_split.h"
#include "tp/group.h"

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

FSDP_PUBLIC_BEGIN

namespace fsdp::tp {

struct VocabParallelEmbeddingOptions {
  VocabParallelEmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  /// The full vocabulary: divisible by the group's size (pad it, as Megatron does, otherwise).
  TORCH_ARG(int64_t, num_embeddings);
  TORCH_ARG(int64_t, embedding_dim);
  /// Reduce-scatter the output along the sequence (dimension 1 of [batch, sequence]) instead of
  /// all-reducing it: each rank gets its part of the sequence, for sequence-parallel blocks.
  TORCH_ARG(bool, sequence_parallel) = false;
};

class VocabParallelEmbeddingImpl : public torch::nn::Cloneable<VocabParallelEmbeddingImpl>, public SplitModule {
 public:
  VocabParallelEmbeddingImpl(Group group, VocabParallelEmbeddingOptions options);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  /// Token ids (integers in [0, V)) of any shape [...] -> [..., C].
  at::Tensor forward(const at::Tensor& ids);
  /// This rank's rows of the vocabulary: [vocab_begin(), vocab_begin() + V / T).
  int64_t vocab_begin() const { return group.rank() * (options.num_embeddings() / group.size()); }
  /// weight: split along dimension 0.
  std::vector<std::pair<std::string, TensorSplit>> parameter_splits() const override {
    return {{"weight", TensorSplit{0, group.rank(), group.size()}}};
  }
  std::vector<int> split_ranks() const override { return group.global_ranks(); }

  Group group;
  VocabParallelEmbeddingOptions options;
  at::Tensor weight;  ///< [V / T, C]
};
TORCH_MODULE(VocabParallelEmbedding);

}  // namespace fsdp::tp

FSDP_PUBLIC_END
