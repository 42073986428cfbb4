#include "tp/embedding.h"

#include "fsdp/internal/check.h"
#include "tp/conjugates.h"

#include <ATen/ops/embedding.h>
#include <torch/nn/modules/embedding.h>

namespace fsdp::tp {

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(Group group, VocabParallelEmbeddingOptions options)
    : group(std::move(group)), options(options) {
  VocabParallelEmbeddingImpl::reset();  // qualified: called from the constructor
}

void VocabParallelEmbeddingImpl::reset() {
  const int64_t V = options.num_embeddings(), C = options.embedding_dim();
  FSDP_CHECK(V > 0 && C > 0, "fsdp::tp::VocabParallelEmbedding on ", group.where(), ": sizes must be positive, not ", V,
             " x ", C, ".");
  FSDP_CHECK(V % group.size() == 0, "fsdp::tp::VocabParallelEmbedding(", V, ", ", C, ") on ", group.where(),
             ": the vocabulary (", V, ") is not divisible by the ", group.size(),
             " tensor-parallel ranks. Pad the vocabulary to a multiple of ", group.size(),
             " (extra rows no token uses), or choose a tensor-parallel size that divides it.");
  const int64_t n = V / group.size();
  torch::nn::Embedding full(V, C);  // drawn in full, as every rank draws it
  weight = register_parameter("weight", full->weight.detach().narrow(0, vocab_begin(), n).clone());
}

void VocabParallelEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "fsdp::tp::VocabParallelEmbedding(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim() << ", part=" << group.rank() << "/" << group.size() << ")";
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  FSDP_CHECK(!at::isFloatingType(ids.scalar_type()) && !ids.is_complex(), "fsdp::tp::VocabParallelEmbedding on ",
             group.where(), ": token ids must be integers, not ", ids.scalar_type(), ".");
  const int64_t V = options.num_embeddings();
  FSDP_CHECK(!options.sequence_parallel() || (ids.dim() >= 2 && ids.size(1) % group.size() == 0),
             "fsdp::tp::VocabParallelEmbedding(", V, ", ", options.embedding_dim(), ") on ", group.where(),
             ": sequence_parallel reduce-scatters its output along the sequence, dimension 1 of [batch, sequence] "
             "ids, which the ",
             group.size(), " tensor-parallel ranks must divide; the ids have shape ", ids.sizes(), ".");
  if (ids.is_cpu() && ids.numel() > 0) {
    // A token outside [0, V) would be zero on every rank, silently: refused as torch::nn::Embedding
    // refuses it. (On a GPU this check would stop the CPU at every forward: not made there.)
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    FSDP_CHECK(lo >= 0 && hi < V, "fsdp::tp::VocabParallelEmbedding(", V, ", ", options.embedding_dim(), ") on ",
               group.where(), ": token id ", lo < 0 ? lo : hi, " is outside the vocabulary [0, ", V, ").");
  }
  const int64_t n = V / group.size();
  const int64_t begin = vocab_begin();
  // This rank's tokens at their row; the others at row 0, their output zeroed below.
  at::Tensor outside = (ids < begin).logical_or(ids >= begin + n);
  at::Tensor local = (ids - begin).masked_fill(outside, 0);
  at::Tensor rows = at::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0);
  return options.sequence_parallel() ? reduce_scatter_to_sequence_region(rows, group, 1)
                                     : reduce_from_region(rows, group);
}

}  // namespace fsdp::tp
