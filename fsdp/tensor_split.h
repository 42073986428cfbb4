// How a parameter is split over tensor-parallel ranks: what fsdp::tp's layers tell fully_shard,
// and what the shard contract (ShardSpec::tp) then says of each parameter. A layer of a user's own
// that splits its weights over a tensor-parallel group implements SplitModule the same way.
#pragma once

#include "fsdp/export.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp {

/// One parameter's split: part `part` of `parts` along dimension `dim` of the full tensor, or not
/// split (`dim` < 0: every tensor-parallel rank holds the same whole tensor, as a norm's weight or
/// a row-parallel layer's bias).
struct TensorSplit {
  int64_t dim = -1;
  int part = 0;
  int parts = 1;
  bool split() const { return dim >= 0 && parts > 1; }
};

/// A module whose parameters are split over a tensor-parallel group (fsdp::tp's layers). Found by
/// fully_shard while wrapping: its parameters' splits enter the shard contract, clipping's norm
/// counts each split part once and each unsplit parameter once per group (not once per rank),
/// and its group must be the mesh's tensor-parallel dimension.
class SplitModule {
 public:
  virtual ~SplitModule() = default;
  /// Each parameter of the module itself (not of its children), by its name in the module.
  virtual std::vector<std::pair<std::string, TensorSplit>> parameter_splits() const = 0;
  /// The global ranks of the group it is split over, in part order.
  virtual std::vector<int> split_ranks() const = 0;
};

}  // namespace fsdp

FSDP_PUBLIC_END
