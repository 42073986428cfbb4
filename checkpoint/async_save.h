// Asynchronous checkpoints: AsyncSaver::save copies this rank's part of the checkpoint (its rows of
// the parameters, of the optimizer's state and of the buffers, and its generators) into a host
// snapshot that the saver keeps for the next save, and returns; a background thread then writes
// the same file and commits the same way as fsdp::checkpoint::save (docs/checkpoint-format.md),
// while training goes on.
//
//   fsdp::checkpoint::AsyncSaver saver(model);   // collective, once: every rank, same order
//   for (int64_t step = 1; ...; ++step) {
//     ... forward, backward, optimizer.step() ...
//     if (step % 100 == 0) saver.save("ckpts", optimizer, fsdp::checkpoint::SaveOptions().step(step));
//   }
//   saver.wait();   // the last save committed (or its error thrown); the destructor waits too
//
// The background thread's agreements go over a process group of its own (the model's ranks,
// rendezvoused once in the constructor), never over the model's: there they would interleave with
// the training's collectives. They are bounded by the model's timeout, like every wait.
#pragma once

#include "checkpoint/checkpoint.h"
#include "fsdp/export.h"

#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>

FSDP_PUBLIC_BEGIN

namespace fsdp::checkpoint {

/// What AsyncSaver::save does while the previous save is still being written on any rank.
enum class IfBusy {
  kWait,  ///< wait for it to end, then start this one
  kSkip,  ///< start nothing and return at once (AsyncSaveStarted::skipped): a save every step
  kThrow  ///< start nothing and throw
};

struct AsyncSaveOptions {
  /// With kSkip and kThrow the ranks agree (an all-reduce on the model's group, in save()), so
  /// that every rank skips or none does.
  TORCH_ARG(IfBusy, if_busy) = IfBusy::kWait;
};

/// What AsyncSaver::save did before returning.
struct AsyncSaveStarted {
  bool skipped = false;        ///< IfBusy::kSkip: a save was being written; nothing was started
  std::string path;            ///< the checkpoint's directory, once committed (empty when skipped)
  int64_t snapshot_bytes = 0;  ///< this rank's bytes copied into the snapshot
  double seconds = 0;          ///< the call's time on this rank: how long training was held
  double waited_seconds = 0;   ///< of which waiting for the previous save to end
};

/// One save in flight at a time, its errors kept until they are reported. Between saves it keeps
/// the snapshot's host memory (the largest rank part so far), so that memory stays flat over many
/// saves. Not thread-safe: call it from the training loop's thread.
class AsyncSaver {
 public:
  /// Collective over the model's ranks (it creates the saver's process group from the model's):
  /// every rank constructs its savers in the same order. The model must outlive every save() call;
  /// the background work does not touch it.
  explicit AsyncSaver(const FSDPModule& model, const AsyncSaveOptions& options = {});
  /// Waits for a save in flight. An error nobody received through save() or wait() is printed to
  /// stderr (a destructor cannot throw).
  ~AsyncSaver();
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  /// Starts saving the model (and `optimizer`'s state) under `root`, collectively: every rank calls
  /// it with the same arguments, between steps. First it waits for the previous save (or throws,
  /// see AsyncSaveOptions) and throws that save's error if it failed, starting nothing; then it
  /// checks what fsdp::checkpoint::save checks before writing (an optimizer the format cannot
  /// hold is refused here), copies this rank's part into the snapshot and returns. The files,
  /// manifest and commit are those of fsdp::checkpoint::save with the same arguments, and a failure
  /// on any rank commits nothing: the previous checkpoint stays the latest.
  AsyncSaveStarted save(const std::string& root, const SaveOptions& options = {});
  AsyncSaveStarted save(const std::string& root, const torch::optim::Optimizer& optimizer,
                        const SaveOptions& options = {});
  /// Waits for the save in flight to end and returns its result (the last save's when none is in
  /// flight; an empty path when that one failed); throws its error, once.
  SaveResult wait();
  /// Whether a save was started and wait() has not seen it end (it may have ended already).
  bool in_flight() const;
  /// Whether this rank's background thread is still writing or committing. This rank's view only:
  /// to skip a save while one is being written, use IfBusy::kSkip, which the ranks agree on.
  bool writing() const;
  /// Bytes of host memory the snapshot keeps between saves.
  int64_t snapshot_capacity() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp::checkpoint

FSDP_PUBLIC_END
