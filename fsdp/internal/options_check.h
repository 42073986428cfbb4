// What fully_shard and the sharding scope check of FullyShardOptions before using them, and the
// CPU test seam of offload. Internal to the library: the public options.h holds the options only.
#pragma once

#include "fsdp/error.h"
#include "fsdp/options.h"

#include <c10/core/Device.h>

#include <string>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace fsdp::detail {

/// Throws, naming `caller`, this rank (of `pg`, the group the options are for) and the option,
/// when a value cannot be used: an unknown strategy, a
/// negative prefetch, a bucket size that is not positive. (Group sizes are checked against the
/// world size when the groups are made.)
void check_options(const FullyShardOptions& options, const char* caller, const c10d::ProcessGroup& pg);
/// Test seam: $FSDP_TEST_OFFLOAD_ON_CPU=1 lets a CPU model take an offload policy, "offloading" to
/// the same CPU through separate buffers, so that CI exercises every copy and pointer switch of
/// the CUDA path (docs/design.md, "CPU offload"). Never for training.
bool offload_on_cpu_for_tests();
/// Refuses an offload policy for a model that has nothing to offload (its parameters, the first of
/// which is `param` on `device`, are not on a CUDA device); `where` names the call and the rank.
void check_offload(const FullyShardOptions& options, const std::string& param, const c10::Device& device,
                   const ErrorContext& where);

}  // namespace fsdp::detail
