// Tensor parallelism as fully_shard sees it: the modules of a model that split their parameters
// over a tensor-parallel group (fsdp::SplitModule, fsdp/tensor_split.h), checked against the
// groups the model is wrapped over and recorded for the shard contract. Internal to the library.
#pragma once

#include <torch/nn/module.h>

namespace fsdp::detail {

class RunState;

/// Finds every SplitModule in `root` whose group has more than one rank, checks that the model was
/// wrapped over a DeviceMesh whose tp group is that group (so the data-parallel group holds one
/// rank of it: sharding must never mix two ranks' parts), and records each of its parameters'
/// TensorSplit in state.tp_splits(). Throws naming the module, the ranks and the remedy.
/// A SplitModule must name every parameter of its own (TensorSplit{} for one held whole), and a
/// split must be along one of the parameter's dimensions, one part per rank of the group.
void record_tensor_splits(RunState& state, torch::nn::Module& root);

/// Checks that every parameter no SplitModule splits holds the same values on every rank of the
/// tensor-parallel group (one all-gather of 64-bit fingerprints over it); throws naming the
/// parameter and the rank that differs. Called by record_tensor_splits.
void check_held_alike(RunState& state, torch::nn::Module& root);

}  // namespace fsdp::detail
