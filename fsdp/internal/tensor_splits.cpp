#include "fsdp/internal/tensor_splits.h"

#include "fsdp/internal/check.h"
#include "fsdp/internal/run_state.h"
#include "fsdp/tensor_split.h"
#include "fsdp/util/tensor_fingerprint.h"

#include <set>
#include <string>
#include <vector>

namespace fsdp::detail {

void record_tensor_splits(RunState& state, torch::nn::Module& root) {
  const Comm& dp = state.comm();
  for (const auto& item : root.named_modules()) {
    const auto* split = dynamic_cast<const SplitModule*>(item.value().get());
    if (split == nullptr) continue;
    const std::vector<int> ranks = split->split_ranks();
    if (ranks.size() <= 1) continue;  // a one-rank group splits nothing
    const std::string& name = item.key();
    const ErrorContext context = dp.error_in("fsdp::fully_shard").unit(name);
    FSDP_CHECK_IN(context, state.tp_comm() != nullptr, "module '", name, "' is tensor parallel over global ranks ",
                  list_ranks(ranks), ", but the model is wrapped over ",
                  dp.world_size() > 1 ? "global ranks " + list_ranks(dp.global_ranks()) : std::string("one rank"),
                  " without a tensor-parallel dimension: sharding would mix the ranks' parts, and clipping would "
                  "miss the other parts' norms. Wrap it over the mesh its layers use: fsdp::fully_shard(model, "
                  "mesh) with a DeviceMesh whose \"tp\" dimension is their fsdp::tp::Group.");
    FSDP_CHECK_IN(context, ranks == state.tp_comm()->global_ranks(), "module '", name,
                  "' is tensor parallel over global ranks ", list_ranks(ranks),
                  ", but the mesh the model is wrapped over has tensor-parallel group ",
                  list_ranks(state.tp_comm()->global_ranks()),
                  " here. Build the layers over fsdp::tp::Group(mesh) of the mesh you pass to fully_shard.");
    const auto own = item.value()->named_parameters(/*recurse=*/false);
    std::set<std::string> named;
    const int part = state.tp_comm()->rank(), parts = state.tp_comm()->world_size();
    for (const auto& [param, how] : split->parameter_splits()) {
      const at::Tensor* p = own.find(param);
      FSDP_CHECK_IN(context, p != nullptr, "module '", name, "' names a split of parameter '", param,
                    "', which it does not have.");
      named.insert(param);
      // A split must be one the checkpoint and clipping can place: along one of the parameter's
      // dimensions, one part per rank of the group, this rank's part its place in the group.
      FSDP_CHECK_IN(context, !how.split() || (how.dim < p->dim() && how.parts == parts && how.part == part), "module '",
                    name, "' says parameter '", param, "' (shape ", p->sizes(), ") is part ", how.part, " of ",
                    how.parts, " along dimension ", how.dim, ", but this rank is part ", part, " of the ", parts,
                    " ranks of its tensor-parallel group and the parameter has ", p->dim(),
                    " dimension(s). Return TensorSplit{dim, the rank's index in split_ranks(), split_ranks().size()} "
                    "with a dimension the parameter has, or TensorSplit{} for one every rank holds whole.");
      state.tp_splits()[p->unsafeGetTensorImpl()] = how;
    }
    for (const auto& kv : own) {
      FSDP_CHECK_IN(context, named.count(kv.key()) == 1, "module '", name,
                    "' is a SplitModule but its parameter_splits() does not name its parameter '", kv.key(),
                    "': name every parameter of the module, TensorSplit{} for one the tensor-parallel ranks hold "
                    "whole, so that nothing is taken as held alike when it is a part.");
    }
  }
  check_held_alike(state, root);
}

void check_held_alike(RunState& state, torch::nn::Module& root) {
  if (!state.tp_comm()) return;
  // What this rank holds of every parameter not split: the same values on every tensor-parallel
  // rank, or the checkpoint would take its rows from different ranks' values and clipping would
  // count one rank's norm for all.
  std::vector<std::pair<std::string, at::Tensor>> alike;
  for (const auto& kv : root.named_parameters()) {
    if (state.tp_splits().count(kv.value().unsafeGetTensorImpl()) == 0) alike.emplace_back(kv.key(), kv.value());
  }
  const std::string mine = util::fingerprint_lines(alike);
  const Comm& tp = *state.tp_comm();
  const auto all = state.tp_comm()->exchange_strings(mine, "fsdp::fully_shard: the parameters held alike");
  for (int r = 0; r < tp.world_size(); ++r) {
    if (all[static_cast<size_t>(r)] == mine) continue;
    ErrorContext context = tp.error_in("fsdp::fully_shard");
    context.peer(tp.global_ranks()[static_cast<size_t>(r)]);
    FSDP_CHECK_IN(context, false, "parameter '", util::first_difference(mine, all[static_cast<size_t>(r)]),
                  "' differs between this rank and global rank ", tp.global_ranks()[static_cast<size_t>(r)],
                  " of its tensor-parallel group, but no fsdp::SplitModule declares it split, so it is taken as held "
                  "alike (a checkpoint would write its rows from different ranks' values, clipping would count one "
                  "rank's). If it is a part of a larger tensor, declare it in the module's parameter_splits(); if "
                  "not, initialize it alike on every tensor-parallel rank (the same seed before building the model).");
  }
}

}  // namespace fsdp::detail
