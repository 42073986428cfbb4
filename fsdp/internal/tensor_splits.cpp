#include "fsdp/internal/tensor_splits.h"

#include "fsdp/internal/check.h"
#include "fsdp/internal/run_state.h"
#include "fsdp/tensor_split.h"

namespace fsdp::detail {

void record_tensor_splits(RunState& state, torch::nn::Module& root) {
  const Comm& dp = state.comm;
  for (const auto& item : root.named_modules()) {
    const auto* split = dynamic_cast<const SplitModule*>(item.value().get());
    if (split == nullptr) continue;
    const std::vector<int> ranks = split->split_ranks();
    if (ranks.size() <= 1) continue;  // a one-rank group splits nothing
    const std::string& name = item.key();
    const ErrorContext context = dp.error_context("fsdp::fully_shard").unit(name);
    FSDP_CHECK_IN(context, state.tp_comm != nullptr, "fsdp::fully_shard (", dp.where(), "): module '", name,
                  "' is tensor parallel over global ranks ", list_ranks(ranks), ", but the model is wrapped over ",
                  dp.world_size() > 1 ? "global ranks " + list_ranks(dp.global_ranks()) : std::string("one rank"),
                  " without a tensor-parallel dimension: sharding would mix the ranks' parts, and clipping would "
                  "miss the other parts' norms. Wrap it over the mesh its layers use: fsdp::fully_shard(model, "
                  "mesh) with a DeviceMesh whose \"tp\" dimension is their fsdp::tp::Group.");
    FSDP_CHECK_IN(context, ranks == state.tp_comm->global_ranks(), "fsdp::fully_shard (", dp.where(), "): module '",
                  name, "' is tensor parallel over global ranks ", list_ranks(ranks),
                  ", but the mesh the model is wrapped over has tensor-parallel group ",
                  list_ranks(state.tp_comm->global_ranks()),
                  " here. Build the layers over fsdp::tp::Group(mesh) of the mesh you pass to fully_shard.");
    for (const auto& [param, how] : split->parameter_splits()) {
      const auto own = item.value()->named_parameters(/*recurse=*/false);
      const at::Tensor* p = own.find(param);
      FSDP_CHECK_IN(context, p != nullptr, "fsdp::fully_shard (", dp.where(), "): module '", name,
                    "' names a split of parameter '", param, "', which it does not have.");
      state.tp_splits[p->unsafeGetTensorImpl()] = how;
    }
  }
}

}  // namespace fsdp::detail
