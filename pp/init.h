// fsdp::pp::parameter_generator: initial weights that depend on a seed and each parameter's name,
// not on which parameters a process builds or in which order.
//
//   const uint64_t seed = fsdp::pp::draw_seed();        // one number from LibTorch's generator
//   for (auto& p : model->named_parameters())           // full names: model.layers.7.mlp.up_proj.weight
//     p.value().normal_(0, 0.02, fsdp::pp::parameter_generator(seed, p.key()));
//
// Why: a pipeline stage builds only its own layers. Drawn in turn from the global generator, layer
// 7's weights would depend on how many layers came before it in this process, so a pipelined run
// would start from other weights than one process; drawn from a generator seeded by (seed, name)
// they are the same on whichever rank holds layer 7, at every pipeline size, and in one process. A
// tied embedding and head built on two stages under one name start from one value.
#pragma once

#include "fsdp/export.h"

#include <ATen/core/Generator.h>

#include <cstdint>
#include <string>

FSDP_PUBLIC_BEGIN

namespace fsdp::pp {

/// A CPU generator seeded from `seed` and `name` (a 64-bit FNV-1a hash of both): the same in every
/// process and on every rank, whatever was drawn before. Draw a tensor whole from it on the CPU
/// (then keep a part, for a tensor-parallel shard): the values then do not depend on the device or
/// the tensor-parallel size either.
at::Generator parameter_generator(uint64_t seed, const std::string& name);

/// One 64-bit number from LibTorch's default CPU generator: the seed a model's constructor takes
/// for parameter_generator, so that torch::manual_seed(s) before it still fixes the weights (and two
/// models built one after the other still differ). Every rank that seeds alike draws alike, if it
/// draws this before building any layer (a layer's own initialization draws from the same generator).
uint64_t draw_seed();

}  // namespace fsdp::pp

FSDP_PUBLIC_END
