// The row layout: which rows of a parameter each rank holds, and where they sit in a unit's flat
// buffers. Pure functions of shapes, used by the library, its tests and its benchmark alike.
//
// Every strategy shards along dim 0. A parameter of `rows` rows (1 for a scalar) sharded over S
// ranks has c = ceil(rows / S) rows per rank: shard rank r holds rows [r*c, min((r+1)*c, rows)),
// possibly none (13 rows over 4 ranks: 4, 4, 4, 1; 5 rows over 4: 2, 2, 1, 0). In a unit's flat
// shard each parameter takes c rows, padded with zeros past its last row, one after the other in
// the unit's parameter order; the all-gathered buffer is rank-major [S, flat shard], so padding
// costs at most S - 1 rows per parameter and the gathered parameter is one contiguous slice of it.
#pragma once

#include "fsdp/export.h"

#include <c10/util/ArrayRef.h>

#include <algorithm>
#include <cstdint>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp {

/// One parameter's dim-0 layout over `shards` ranks.
struct RowLayout {
  int64_t rows = 0;       ///< dim 0, or 1 for a scalar
  int64_t row_numel = 1;  ///< elements per row (product of the other dims)
  int64_t shards = 1;     ///< S: ranks the parameter is sharded over (1: replicated)

  /// c = ceil(rows / S): rows per rank, padding included.
  int64_t chunk_rows() const { return (rows + shards - 1) / shards; }
  /// First row held by shard rank `r` (clamped to `rows`: a rank past the end holds none).
  int64_t begin(int64_t r) const { return std::min(rows, r * chunk_rows()); }
  /// One past the last row held by shard rank `r`.
  int64_t end(int64_t r) const { return std::min(rows, (r + 1) * chunk_rows()); }
  /// Rows shard rank `r` holds: end(r) - begin(r), between 0 and c.
  int64_t local_rows(int64_t r) const { return end(r) - begin(r); }
  /// Elements each rank reserves for the parameter in a flat shard: c rows.
  int64_t padded_numel() const { return chunk_rows() * row_numel; }
  /// Elements of the whole parameter.
  int64_t numel() const { return rows * row_numel; }
};

/// The layout of a parameter of `shape` over `shards` ranks.
inline RowLayout row_layout(c10::IntArrayRef shape, int64_t shards) {
  RowLayout l;
  l.rows = shape.empty() ? 1 : shape[0];
  for (size_t d = 1; d < shape.size(); ++d) l.row_numel *= shape[d];
  l.shards = shards;
  return l;
}

/// The shape of shard rank `r`'s rows of a parameter of `shape`: dim 0 is local_rows(r); a scalar
/// stays a scalar on the rank that holds it and is [0] elsewhere.
inline std::vector<int64_t> local_shape(c10::IntArrayRef shape, const RowLayout& l, int64_t r) {
  std::vector<int64_t> out = shape.vec();
  if (out.empty()) {
    if (l.local_rows(r) == 0) out = {0};
  } else {
    out[0] = l.local_rows(r);
  }
  return out;
}

/// Where each parameter's c rows start in a unit's flat shard, in parameter order, and (last
/// element) the flat shard's size: offsets[i + 1] - offsets[i] == layouts[i].padded_numel().
inline std::vector<int64_t> flat_offsets(const std::vector<RowLayout>& layouts) {
  std::vector<int64_t> out{0};
  for (const auto& l : layouts) out.push_back(out.back() + l.padded_numel());
  return out;
}

}  // namespace fsdp

FSDP_PUBLIC_END
