// The shard contract: what this rank holds of each parameter of a wrapped model, and each unit's
// flat buffers. Everything outside the core (optimizers, clipping, checkpoints) works from this
// description and the public handle, never from the library's internals.
//
//   for (const auto& p : model.shard_specs())     // fixed order: units in model order, then params
//     save(p.name, p.global_shape, p.row_begin, p.local);   // this rank's rows [row_begin, row_end)
//
// An optimizer's state for a parameter (a moment) has the parameter's layout: its rows
// [row_begin, row_end) of a tensor of global_shape.
#pragma once

#include "fsdp/export.h"
#include "fsdp/options.h"
#include "fsdp/shard_layout.h"
#include "fsdp/tensor_split.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp {

/// One parameter of a wrapped model as this rank holds it.
struct ShardSpec {
  /// Fully qualified name in the root module (a weight tied inside a unit appears once, under its
  /// first name in module order).
  std::string name;
  std::vector<int64_t> global_shape;  ///< the full parameter's shape
  at::ScalarType dtype = at::kFloat;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  size_t unit = 0;  ///< index of its unit in units()
  /// Its dim-0 layout over the ranks it is sharded over (rows per rank, padding).
  RowLayout layout;
  /// This rank's place among the `shard_world_size` ranks the parameter is sharded over (the
  /// world, a hybrid group, or 1 when replicated) ...
  int shard_rank = 0;
  int shard_world_size = 1;
  /// ... and among the `replicas` groups that hold the same rows (1 when fully sharded, the world
  /// size when replicated, N/S for hybrid). Ranks r with r / shard_world_size == replica_rank form
  /// this rank's shard group (groups are consecutive ranks).
  int replica_rank = 0;
  int replicas = 1;
  /// Global rows held here: [row_begin, row_end), possibly empty.
  int64_t row_begin = 0;
  int64_t row_end = 0;
  /// Those rows: the module's own parameter between steps (its .grad() is the sharded gradient,
  /// the mean over ranks). Shape local_shape(global_shape, layout, shard_rank).
  at::Tensor local;
  /// Where its c = layout.chunk_rows() rows start in its unit's flat shard.
  int64_t flat_offset = 0;
  /// Tensor parallelism (a model of fsdp::tp layers wrapped over a DeviceMesh, fsdp/tensor_split.h):
  /// how the parameter is split over the mesh's `tp_size` tensor-parallel ranks (tp.split() false:
  /// not split, each of them holds the same whole tensor). global_shape and the rows above are then
  /// those of this rank's tensor-parallel part, sharded over the data-parallel ranks.
  TensorSplit tp;
  int tp_size = 1;
  /// This rank's coordinate along the mesh's tensor-parallel dimension (tp.part when split): the
  /// ranks of one data-parallel group with different tp_rank hold an unsplit parameter alike.
  int tp_rank = 0;
};

/// One unit (an fsdp::Sharded module, or the root's own parameters) as this rank holds it.
struct UnitInfo {
  std::string name;  ///< module path of the unit ("" for the root unit)
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int64_t shard_numel = 0;       ///< elements of this rank's flat shard, padding included
  int64_t shard_rank = 0;        ///< this rank's place among the ranks the unit is sharded over
  int64_t shard_world_size = 1;  ///< those ranks: N, S (hybrid) or 1 (replicated)
  bool unsharded = false;        ///< whether its parameters are their full views now
  /// Mixed precision (fsdp/mixed_precision.h): the dtype its parameters are gathered and computed
  /// in, and the one its gradients are reduced in; both the shards' own dtype without a policy.
  at::ScalarType param_dtype = at::kFloat;
  at::ScalarType reduce_dtype = at::kFloat;
  std::vector<std::string> params;  ///< its parameters' names, in flat-shard order
  std::vector<size_t> specs;        ///< the same parameters: indices into shard_specs()
  /// This rank's rows of every parameter, each padded to its c rows, at its flat_offset: what the
  /// parameters alias between steps. Undefined for kShardOptimizerState, whose shards are rows of
  /// the full parameters.
  at::Tensor flat_shard;
  /// The sharded gradients in the same layout, when every parameter with elements has its
  /// gradient in one such buffer at its offset (the usual case after a backward that reduced
  /// them): a fused optimizer may then update flat_shard in one pass. Undefined otherwise, and at
  /// world size 1, where nothing is reduced and each gradient stays the tensor autograd produced.
  at::Tensor flat_grad;
};

}  // namespace fsdp

FSDP_PUBLIC_END
