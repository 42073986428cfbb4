// The Llama and Hugging Face's files: a directory's config.json read into llama::Config (what the
// C++ model does not implement refused by name), its safetensors weights read into a
// tensor-parallel model (each rank reading only the bytes of its parts), logits written as
// safetensors, and the trained model exported as a directory LlamaForCausalLM.from_pretrained
// loads, one tensor in memory at a time.
#pragma once

#include "checkpoint/safetensors.h"
#include "examples/llama/llama.h"
#include "fsdp/fully_shard.h"
#include "programs/flags.h"

#include <torch/nn/module.h>

#include <string>
#include <vector>

namespace llama::hf {

/// The model's shape from DIR/config.json (LlamaForCausalLM only). Refused, as fsdp::programs::UsageError
/// naming the key: another architecture, an activation other than silu, rope scaling, biases,
/// pretraining_tp other than 1, a vocabulary under 256 (the example's byte corpus).
Config read_config(const std::string& dir, int64_t block_size);

/// Reads DIR's model.safetensors (or the files model.safetensors.index.json names) into `model`
/// before it is wrapped: each parameter's part along its split (fsdp::SplitModule), converted to
/// fp32; a tensor missing or of another shape is an error naming it and the file. Rank 0 warns of
/// the file's tensors the model has no parameter for; with `stage_of` (`model` one pipeline stage
/// of that whole model), only of those the whole model has none for.
void load_weights(const std::string& dir, torch::nn::Module& model, const Config* stage_of = nullptr);

/// Writes `logits` ([T, V], converted to fp32) as FILE, one tensor named "logits".
void write_logits(const std::string& file, const at::Tensor& logits);

/// Writes OUT/config.json and OUT/model.safetensors from the wrapped model: each parameter whole,
/// assembled from every rank's rows of every tensor-parallel part (one all-reduce over the mesh
/// per parameter), written by rank 0 as it arrives: one tensor in memory at a time. Collective.
void export_model(const std::string& out, const fsdp::FSDPModule& model, const fsdp::DeviceMesh& mesh,
                  const Config& config);
/// The same from a pipelined model: this rank's stages' models, `copies[i]` the names of tensors
/// model i holds as copies of an earlier stage's (a tied head's embedding on the last stage,
/// written from the first). Every tensor of the whole model assembled over the mesh's world, one
/// all-reduce each. Stages that do not match `config` (a shape, a tensor it does not name) throw
/// std::logic_error on every rank, before anything is written.
void export_model(const std::string& out, const std::vector<fsdp::FSDPModule>& models,
                  const std::vector<std::vector<std::string>>& copies, const fsdp::DeviceMesh& mesh,
                  const Config& config);

}  // namespace llama::hf
