#include "fsdp/options.h"

#include <c10/util/Exception.h>

namespace fsdp {

namespace detail {
void check_options(const FullyShardOptions& o, const char* caller) {
  TORCH_CHECK(is_valid(o.strategy()), caller, ": FullyShardOptions::strategy is ", static_cast<int>(o.strategy()),
              ", not a ShardingStrategy; use one of fsdp::ShardingStrategy's values (fsdp/strategy.h).");
  TORCH_CHECK(o.prefetch() >= 0, caller, ": FullyShardOptions::prefetch is ", o.prefetch(),
              "; it is the number of units gathered ahead, 0 or more (0 turns prefetch off).");
  TORCH_CHECK(o.bucket_bytes() > 0, caller, ": FullyShardOptions::bucket_bytes is ", o.bucket_bytes(),
              "; replicated units all-reduce their gradients in buckets of that many bytes, so it must be "
              "positive (PyTorch DDP's default is 25 MiB).");
  TORCH_CHECK(o.timeout().count() > 0, caller, ": FullyShardOptions::timeout is ", o.timeout().count(),
              " ms; it bounds every wait for a collective, so it must be positive (the default is 10 minutes).");
}
}  // namespace detail

}  // namespace fsdp
