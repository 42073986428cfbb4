// The examples' checkpoints (train_gpt, train_llama): their flags, the resume at start-up (the latest checkpoint, its
// seed first, then the model, the optimizer, the generators and the sampler), and the saves every --save-every steps,
// synchronous, or with --async-save in the background (fsdp::checkpoint::AsyncSaver), where a save
// that finds the previous one still being written is skipped on every rank and counted. After each
// step it also counts the steps a failure would lose: those since the latest committed checkpoint.
#pragma once

#include "checkpoint/async_save.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/commit.h"
#include "checkpoint/manifest.h"
#include "checkpoint/pipelined.h"
#include "data/distributed_sampler.h"
#include "optim/grad_scaler.h"
#include "programs/flags.h"
#include "programs/json_row.h"

#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>

namespace examples {

/// The checkpoint flags: --save-dir DIR, --save-every K, --resume, --async-save, --keep-last N,
/// --direct-io.
struct CheckpointFlags {
  std::string dir;         // sharded checkpoints (fsdp::checkpoint) go here
  int64_t every = 0;       // steps between checkpoints (0: none)
  bool resume = false;     // from dir's latest checkpoint, when there is one
  bool async = false;      // save in the background (fsdp::checkpoint::AsyncSaver), skipping a busy save
  int64_t keep_last = 0;   // checkpoints kept (0: all)
  bool direct_io = false;  // the checkpoints' files written with O_DIRECT

  /// These flags in a program's table.
  void add_to(fsdp::programs::Flags& f) {
    f.text("--save-dir", dir, "sharded checkpoints under DIR", "DIR")
        .integer("--save-every", every, 1, INT64_MAX, "a checkpoint after every K steps", "K")
        .toggle("--resume", resume, "continue from --save-dir's latest checkpoint")
        .toggle("--async-save", async, "save in the background (a save due while one is written is skipped)")
        .integer("--keep-last", keep_last, 1, 1 << 20, "keep the N latest checkpoints")
        .toggle("--direct-io", direct_io, "write the checkpoints with O_DIRECT");
  }

  /// A flag without the ones it needs is an input error that says what to add.
  void check() const {
    auto refuse = [](const std::string& what) { fsdp::programs::usage_error(what); };
    if (dir.empty() && (every > 0 || resume))
      refuse(std::string(resume ? "--resume" : "--save-every") + " needs --save-dir DIR");
    if ((async || keep_last > 0 || direct_io) && every == 0) {
      refuse(std::string(async ? "--async-save" : direct_io ? "--direct-io" : "--keep-last") + " needs --save-every K");
    }
    if (!dir.empty() && every == 0 && !resume) {
      refuse("--save-dir alone saves nothing: add --save-every K (a checkpoint every K steps), or --resume");
    }
  }
};

class Checkpoints {
 public:
  explicit Checkpoints(const CheckpointFlags& flags)
      : dir_(flags.dir),
        resume_(flags.resume),
        every_(flags.every),
        async_(flags.async),
        keep_last_(static_cast<int>(flags.keep_last)),
        direct_io_(flags.direct_io) {}

  /// The latest checkpoint under the directory ("" when there is none) and the seed its sampler
  /// was built with (a checkpoint without a sampler state is refused: not this program's).
  std::string latest(uint64_t& seed) const {
    const std::string path = fsdp::checkpoint::latest_checkpoint(dir_);
    if (path.empty()) return path;
    const auto saved = fsdp::checkpoint::read_manifest(path).data;
    if (!saved) {
      throw std::runtime_error("checkpoint '" + path +
                               "' holds no data sampler state: it was not saved by this example. Pass another "
                               "--save-dir.");
    }
    seed = saved->seed;
    return path;
  }

  /// With --resume, the checkpoint to resume from (its sampler's seed into `seed`); "" without
  /// --resume, or when the directory holds none yet, which rank 0 says on stderr (after `who`).
  /// The run continues with the checkpoint's seed (its weights and data order came from it): a
  /// --seed that differs is said on stderr, not silently replaced.
  std::string resume_from(uint64_t& seed, int rank, const std::string& who) const {
    if (!resume_) return "";
    const uint64_t requested = seed;
    const std::string path = latest(seed);
    if (path.empty() && rank == 0) std::cerr << who << ": no checkpoint under '" << dir_ << "'; starting at step 0\n";
    if (!path.empty() && seed != requested && rank == 0) {
      std::cerr << who << ": warning: --seed " << requested << " ignored: resuming '" << path
                << "' continues with the checkpoint's seed " << seed
                << " (its data order); to train with another seed, start a new --save-dir\n";
    }
    return path;
  }

  /// fp16 resumed: the checkpoint's loss scale and growth count (saved from scaler.state_dict() in
  /// its metadata; a fresh scale would overflow and skip steps the uninterrupted run took). A
  /// checkpoint without them (saved in fp32 or bf16) leaves the initial scale, said on rank 0's
  /// stderr. Nothing when the scaler is off.
  static void restore_loss_scale(fsdp::optim::ShardedGradScaler& scaler, const fsdp::checkpoint::Metadata& metadata,
                                 int rank, const std::string& who) {
    if (!scaler.options().enabled()) return;
    if (metadata.count("grad_scaler.scale") != 0U) {
      scaler.load_state_dict(metadata);
    } else if (rank == 0) {
      std::cerr << who << ": the checkpoint holds no fp16 loss scale (saved without --mixed-precision fp16): "
                << "starting from the initial scale " << scaler.get_scale() << "\n";
    }
  }

  /// What a resume read, on rank 0: a JSON row (with --json) of the bytes it needed and read over
  /// every rank, or a line on stderr after `who`.
  static void print_resumed(const fsdp::checkpoint::LoadResult& res, const std::string& mesh, bool json,
                            const std::string& who) {
    if (json) {
      fsdp::programs::JsonRow()
          .add("resumed", res.path)
          .add("step", res.step)
          .add("saved_world_size", res.saved_world_size)
          .add("mesh", mesh)
          .add("bytes_needed", res.bytes_needed_total)
          .add("bytes_read", res.bytes_read_total)
          .add("load_seconds", res.seconds, "%.4f")
          .print();
    } else {
      std::cerr << who << ": resumed from '" << res.path << "' (saved by " << res.saved_world_size
                << " rank(s)) at step " << res.step << " on mesh " << mesh << "\n";
    }
  }

  /// After step `step` (0-based): saves when it is due, named by the next step to run (a resume
  /// starts there), and says what it did ("" when nothing was due); then counts the steps since
  /// the latest committed checkpoint.
  std::string after_step(int64_t step, const fsdp::FSDPModule& model, const torch::optim::Optimizer& opt,
                         const fsdp::data::DistributedSampler& sampler, const fsdp::checkpoint::Metadata& metadata) {
    std::string did;
    if (due(step)) {
      const auto options = options_for(step, sampler, metadata);
      if (async_) {
        if (!saver_) {
          saver_ = std::make_unique<fsdp::checkpoint::AsyncSaver>(
              model, fsdp::checkpoint::AsyncSaveOptions().if_busy(fsdp::checkpoint::IfBusy::kSkip));
        }
        const auto started = saver_->save(dir_, opt, options);
        (started.skipped ? skipped_ : started_) += 1;
        held_seconds_ += started.seconds;
        did = started.skipped ? "skipped the save of step " + std::to_string(step + 1) +
                                    " (the previous one is still being written)"
                              : "saving '" + started.path + "' in the background";
      } else {
        const auto res = fsdp::checkpoint::save(dir_, model, opt, options);
        started_ += 1;
        held_seconds_ += res.seconds;
        did = said(res);
      }
    }
    count_lost(step);
    return did;
  }

  /// The same for a pipelined model's stages (checkpoint/pipelined.h), synchronous (--async-save
  /// is refused with --pp).
  std::string after_step(int64_t step, const fsdp::DeviceMesh& mesh,
                         const std::vector<fsdp::checkpoint::StageState>& stages,
                         const fsdp::data::DistributedSampler& sampler, const fsdp::checkpoint::Metadata& metadata) {
    std::string did;
    if (due(step)) {
      const auto res = fsdp::checkpoint::save(dir_, mesh, stages, options_for(step, sampler, metadata));
      started_ += 1;
      held_seconds_ += res.seconds;
      did = said(res);
    }
    count_lost(step);
    return did;
  }

  /// Waits for a save in flight (its error thrown).
  void finish() {
    if (saver_) saver_->wait();
  }

  int64_t started() const { return started_; }
  int64_t skipped() const { return skipped_; }
  int64_t lost_max() const { return lost_max_; }
  double lost_mean() const { return steps_ > 0 ? static_cast<double>(lost_sum_) / static_cast<double>(steps_) : 0; }
  /// Seconds the training loop was held by saves (the copy into the snapshot, for --async-save).
  double held_seconds() const { return held_seconds_; }

  /// The step the latest committed checkpoint resumes at (0: none): its name's number, read from
  /// the directory (a background save counts once it is committed).
  int64_t committed_step() const {
    if (dir_.empty()) return 0;
    const std::string path = fsdp::checkpoint::latest_checkpoint(dir_);
    const size_t dash = path.rfind("step-");
    return dash == std::string::npos ? 0 : std::stoll(path.substr(dash + 5));
  }

 private:
  bool due(int64_t step) const { return every_ > 0 && (step + 1) % every_ == 0; }
  fsdp::checkpoint::SaveOptions options_for(int64_t step, const fsdp::data::DistributedSampler& sampler,
                                            const fsdp::checkpoint::Metadata& metadata) const {
    return fsdp::checkpoint::SaveOptions()
        .step(step + 1)
        .sampler_state(sampler.state())
        .keep_last(keep_last_)
        .direct_io(direct_io_)
        .metadata(metadata);
  }
  static std::string said(const fsdp::checkpoint::SaveResult& res) {
    return "saved '" + res.path + "' (" + std::to_string(res.bytes_total) + " bytes in " + std::to_string(res.seconds) +
           " s)";
  }
  void count_lost(int64_t step) {
    if (every_ == 0) return;
    const int64_t lost = step + 1 - committed_step();
    lost_max_ = std::max(lost_max_, lost);
    lost_sum_ += lost;
    steps_ += 1;
  }

  std::string dir_;
  bool resume_;
  int64_t every_;
  bool async_;
  int keep_last_;
  bool direct_io_;
  std::unique_ptr<fsdp::checkpoint::AsyncSaver> saver_;
  int64_t started_ = 0, skipped_ = 0, lost_max_ = 0, lost_sum_ = 0, steps_ = 0;
  double held_seconds_ = 0;
};

}  // namespace examples
