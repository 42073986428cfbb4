// Sharded checkpoints of a wrapped model: every rank writes its own file in parallel, each unique
// byte once, and one rank commits the checkpoint atomically (docs/checkpoint-format.md).
//
//   auto r = fsdp::checkpoint::save("ckpts", model, fsdp::checkpoint::SaveOptions().step(100));
//   // ckpts/step-000100/{rank-00000.safetensors, ..., manifest.json}, ckpts/latest
//
//   auto l = fsdp::checkpoint::load("ckpts", model);   // the latest, on any number of ranks
//   auto l = fsdp::checkpoint::load("ckpts/step-000100", *plain_model);   // one process, unwrapped
//
//   fsdp::checkpoint::save("ckpts", model, optimizer, ...); fsdp::checkpoint::load("ckpts", model, optimizer);
//
// Saved and loaded: the model's parameters and buffers, the optimizer's state, each rank's random
// number generators, the step, the data sampler's state and the user's metadata.
#pragma once

#include "data/distributed_sampler.h"
#include "fsdp/export.h"
#include "fsdp/fully_shard.h"

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

FSDP_PUBLIC_BEGIN

namespace fsdp::checkpoint {

using Metadata = std::map<std::string, std::string>;

struct SaveOptions {
  /// The training step, recorded in the manifest; the default name is step_name(step).
  TORCH_ARG(int64_t, step) = 0;
  /// The checkpoint's directory name under the root (default "step-NNNNNN"). A committed checkpoint
  /// of that name is refused while `latest` names it, and replaced otherwise (a resumed job saving
  /// a step again; docs/checkpoint-format.md, "Commit").
  TORCH_ARG(std::string, name) = "";
  /// Keep only the newest K committed checkpoints under the root after this one (0: keep all).
  TORCH_ARG(int, keep_last) = 0;
  /// Each tensor's CRC32C is taken per block of at most this many bytes.
  TORCH_ARG(uint64_t, block_bytes) = uint64_t{1} << 20;
  /// The user's own key/values, kept in the manifest.
  TORCH_ARG(Metadata, metadata);
  /// The data sampler's state, `sampler.state()` (data/distributed_sampler.h), kept in the
  /// manifest ("data") and restored by load with LoadOptions::sampler. A value taken at the call,
  /// so an asynchronous save keeps the state of the step it saves. Every rank passes its own
  /// sampler's; they must be equal (the save fails on every rank otherwise).
  TORCH_ARG(std::optional<data::SamplerState>, sampler_state);
  /// Each rank's random number generator states (CPU, and each CUDA device's), which a load
  /// restores (see LoadOptions::rng_states).
  TORCH_ARG(bool, rng_states) = true;
  /// Threads writing this rank's file at once, each whole 8 MiB blocks at their offsets (a
  /// parallel filesystem serves concurrent writes to one file from several storage servers).
  TORCH_ARG(int, io_threads) = 1;
  /// Write with O_DIRECT through aligned buffers, bypassing the page cache (which a checkpoint
  /// would otherwise fill and evict the job's pages from): the alignment comes from statx where
  /// the kernel gives it, 4096 otherwise. The files are the same byte for byte. A filesystem that
  /// does not support direct I/O is an error; leave it off there.
  TORCH_ARG(bool, direct_io) = false;
};

struct SaveResult {
  std::string path;           ///< the committed checkpoint's directory
  int64_t bytes_written = 0;  ///< by this rank: its file's tensor bytes
  int64_t bytes_total = 0;    ///< by all ranks (rank 0 only; 0 elsewhere)
  double seconds = 0;         ///< this rank, from the call to its return
};

/// Saves `model` under `root` (a directory every rank sees: a parallel filesystem, or a local disk
/// for one host), collectively: every rank calls it with the same arguments, between steps. Each
/// rank writes its rows (checkpoint/plan.h) to its own safetensors file in a staging directory and
/// fsyncs it; rank 0 then writes the manifest and commits (checkpoint/commit.h). Every wait is
/// bounded by the model's timeout; a failure on any rank fails every rank with its reason, and
/// leaves the previous checkpoint the latest.
SaveResult save(const std::string& root, const FSDPModule& model, const SaveOptions& options = {});
/// Also saves `optimizer`'s state (built on the wrapped model's parameters: torch::optim::SGD,
/// Adam, AdamW or fsdp::optim::FusedAdamW): each parameter's state tensors, which have its layout,
/// with the same plan (each unique byte once), its step, and each param group's hyperparameters.
SaveResult save(const std::string& root, const FSDPModule& model, const torch::optim::Optimizer& optimizer,
                const SaveOptions& options = {});

struct LoadOptions {
  /// Refuse a checkpoint that holds model tensors the model does not have (as LibTorch's and
  /// PyTorch's strict state-dict loading do); with false they are left unread. A tensor the model
  /// has and the checkpoint lacks is always refused.
  TORCH_ARG(bool, strict) = true;
  /// Restore the random number generators: rank r takes the states rank r saved; a rank the saving
  /// job did not have (a load on more ranks) seeds its own from a checksum of rank 0's saved state
  /// and its rank, so the same resume draws the same numbers. Nothing happens for a checkpoint
  /// saved without them.
  TORCH_ARG(bool, rng_states) = true;
  /// Threads issuing this rank's preads at once (each at most 8 MiB).
  TORCH_ARG(int, io_threads) = 1;
  /// Read the bytes straight into the model's shards and the optimizer's state (where the
  /// destination is contiguous CPU memory of the saved dtype and the rows are whole checksum
  /// blocks, as in a load at the saving world size), each block verified by the thread that read
  /// it: no host copy of the checkpoint. The price: a load that fails once reading has begun (a
  /// corrupt block, a rank that fails) has overwritten part of the shards, so the model is marked
  /// unusable (its next forward and any save refuse, saying why): build it again and load a good
  /// checkpoint. Default false: everything is read and verified into host memory first, and a
  /// failed load leaves the model as it was. For a restarted job, whose model holds nothing yet.
  TORCH_ARG(bool, in_place) = false;
  /// A data sampler to resume at the saved state (SaveOptions::sampler_state), on any number of
  /// ranks. Checked with the model, before anything changes: the checkpoint must hold a sampler
  /// state for the same dataset size, seed and shuffle (the message says which differs).

 public:
  LoadOptions& sampler(data::DistributedSampler* s) {
    sampler_ = s;
    return *this;
  }
  data::DistributedSampler* sampler() const { return sampler_; }

 private:
  data::DistributedSampler* sampler_ = nullptr;
};

struct LoadResult {
  std::string path;  ///< the checkpoint's directory
  std::string name;
  int64_t step = 0;
  int saved_world_size = 0;  ///< ranks that saved it
  Metadata metadata;         ///< the user's, as saved
  /// The sampler state saved with it (SaveOptions::sampler_state), whether or not a sampler was
  /// given to restore.
  std::optional<data::SamplerState> sampler_state;
  /// Tensor bytes this rank needed and read (reads are whole checksum blocks, so read >= needed);
  /// the manifest (manifest_bytes, read by every rank) is counted apart.
  int64_t bytes_needed = 0, bytes_read = 0;
  /// The same over every rank (the wrapped model's load; this rank's for a plain module).
  int64_t bytes_needed_total = 0, bytes_read_total = 0;
  int64_t manifest_bytes = 0;
  int64_t preads = 0, files_opened = 0;  ///< this rank's
  /// This rank's generators: "restored" (its saved states), "derived" (a new rank), "not saved",
  /// or "not loaded" (LoadOptions::rng_states false, or a plain module).
  std::string rng = "not loaded";
  /// While the model's replicas train apart (fsdp::optim::LocalSGD, DiLoCo): what they loaded, "each
  /// of the 2 replicas its own state, at inner step 6", or "restarted from the global state at
  /// inner step 4 (saved by 2 replicas training apart, loaded on 1)", followed by "; saved by DiLoCo
  /// every 4 steps, loaded by LocalSGD every 6: ..." when the kind or H changed. A checkpoint of
  /// replicas apart loaded into a model that does not train apart: "the global state (...)".
  /// Empty otherwise.
  std::string replicas;
  double seconds = 0;  ///< this rank, from the call to its return
};

/// Loads the checkpoint at `path` (a checkpoint directory, or a root: its latest) into `model`,
/// collectively: every rank calls it, between steps, whatever number of ranks and strategies
/// saved it. Each rank reads only the bytes of the rows it holds (with their checksum blocks)
/// and fills its shards. Before any tensor of the model is written, every rank checks the
/// checkpoint against the model (every parameter and buffer present with its dtype and global
/// shape; with `strict`, no other model tensor; the files it reads present and of their size) and
/// reads and verifies its bytes; if that fails on any rank, every rank throws, naming the file,
/// the tensor and the rank, and the model is left as it was. Bounded by the model's timeout.
LoadResult load(const std::string& path, FSDPModule& model, const LoadOptions& options = {});
/// Also loads `optimizer`'s state, saved with the model (the same optimizer type and param groups,
/// by parameter name, whatever the number of ranks): each parameter's state tensors (its rows
/// now), its step, and each group's hyperparameters (learning rate included, so that a schedule
/// resumes where it was). A parameter without saved state has none afterwards, as in PyTorch's
/// Optimizer.load_state_dict. Checked with the model, before either changes.
LoadResult load(const std::string& path, FSDPModule& model, torch::optim::Optimizer& optimizer,
                const LoadOptions& options = {});

/// Loads Hugging Face safetensors weights into `model` on any number of ranks, each rank reading
/// only the bytes of its rows: `path` is a .safetensors file, a model.safetensors.index.json, or a
/// directory holding one of them (the index first). `name_map` turns each tensor's name in the
/// files into the model's LibTorch name ("" skips the tensor); without it the names are taken as
/// they are. Checked like a checkpoint (every parameter and buffer present, dtype and shape; with
/// `strict`, no other tensor) on every rank before the model changes; the files carry no
/// checksums, so their bytes are not verified. Collective, between steps.
LoadResult load_safetensors(const std::string& path, FSDPModule& model, const LoadOptions& options = {},
                            const std::function<std::string(const std::string&)>& name_map = {});

/// Loads the checkpoint at `path`, saved by any number of ranks, into a plain (unwrapped) module
/// in one process: every parameter and buffer whole, with the same checks (for inference or
/// export). A tied weight is read once, under its first name.
LoadResult load(const std::string& path, torch::nn::Module& module, const LoadOptions& options = {});
template <typename Impl>
LoadResult load(const std::string& path, torch::nn::ModuleHolder<Impl>& module, const LoadOptions& options = {}) {
  return load(path, *module.ptr(), options);
}

}  // namespace fsdp::checkpoint

FSDP_PUBLIC_END
