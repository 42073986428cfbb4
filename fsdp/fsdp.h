// libtorch-fsdp: fully sharded data parallel training for LibTorch. The one header to include: the
// whole library, as <torch/all.h> is the whole of LibTorch: the core (fsdp/), the optimizers and
// clipping (optim/, fsdp::optim), the distributed sampler (data/, fsdp::data), the tensor-parallel
// layers (tp/, fsdp::tp), the pipeline's stages and transfers (pp/, fsdp::pp) and the sharded
// checkpoints (checkpoint/, fsdp::checkpoint). The CMake target fsdp::fsdp links all six; a program
// that wants less includes the headers it uses.
#pragma once

#include "checkpoint/async_save.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/commit.h"
#include "checkpoint/consolidate.h"
#include "checkpoint/pipelined.h"
#include "data/batch_plan.h"
#include "data/distributed_sampler.h"
#include "data/loader_sampler.h"
#include "data/permutation.h"
#include "fsdp/device_mesh.h"
#include "fsdp/error.h"
#include "fsdp/export.h"
#include "fsdp/fake_process_group.h"
#include "fsdp/fully_shard.h"
#include "fsdp/memory.h"
#include "fsdp/mixed_precision.h"
#include "fsdp/options.h"
#include "fsdp/process_group.h"
#include "fsdp/shard_layout.h"
#include "fsdp/sharded.h"
#include "fsdp/sharding_scope.h"
#include "optim/clip_grad_norm.h"
#include "optim/diloco.h"
#include "optim/fused_adamw.h"
#include "optim/grad_scaler.h"
#include "optim/local_sgd.h"
#include "optim/state_bytes.h"
#include "pp/action.h"
#include "pp/init.h"
#include "pp/pipeline.h"
#include "pp/point_to_point.h"
#include "pp/schedule.h"
#include "pp/simulate.h"
#include "pp/split_backward.h"
#include "pp/stage_layout.h"
#include "pp/stage_mesh.h"
#include "pp/stage_split.h"
#include "tp/conjugates.h"
#include "tp/cross_entropy.h"
#include "tp/embedding.h"
#include "tp/group.h"
#include "tp/linear.h"

FSDP_PUBLIC_BEGIN

FSDP_PUBLIC_END
