// AsyncSaver: the snapshot on the caller's thread, the write and the commit on a background thread
// over the saver's own process group (checkpoint/async_save.h, internal/save_steps.h).
#include "checkpoint/async_save.h"
#include "checkpoint/plan.h"
#include "fsdp/error.h"
#include "fsdp/internal/check.h"

#include "checkpoint/internal/save_steps.h"
#include "fsdp/process_group.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <thread>
#include <vector>

namespace fsdp::checkpoint {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The background error's context (rank, operation, group, peer), so that the error save() or wait()
// throws for it answers Error::operation() and Error::peer() as a synchronous save's would.
ErrorContext context_of(const std::exception_ptr& e) {
  if (!e) return {};
  try {
    std::rethrow_exception(e);
  } catch (const fsdp::Error& err) {
    return err.where();
  } catch (...) {
    return {};
  }
}

// The snapshot is this rank's file's data as it lies on disk: the tensors back to back in file
// order from an address aligned to this, as the data's place in the file is (a multiple of
// WriteOptions::alignment, 4096), so that a direct write (SaveOptions::direct_io) goes straight
// from the snapshot instead of through a copy into aligned buffers
// (checkpoint/internal/parallel_io.h).
constexpr int64_t kSnapshotAlign = 4096;

}  // namespace

struct AsyncSaver::Impl {
  const FSDPModule& model;
  AsyncSaveOptions options;
  detail::Group group;  // the saver's own ranks: never the model's process group (but for one rank)
  at::Tensor snapshot;  // bytes, reused while large enough
  // A snapshot of CUDA tensors: the end of its copy on a side stream, which the background thread
  // waits for before it reads the snapshot.
  std::shared_ptr<c10::Event> copied;
  std::thread worker;
  std::string what;    // "the save of 'root/name'", for errors
  bool report = true;  // false: its error was thrown by save() already (a failed preparation)
  std::exception_ptr error;
  SaveResult result;
  std::atomic<bool> done{false};  // the background thread has ended

  Impl(const FSDPModule& m, const AsyncSaveOptions& o) : model(m), options(o) {
    const auto& pg = detail::checkpoint_group(m);  // the model's, or a tensor-parallel one's mesh
    if (pg->getSize() == 1) {
      group = detail::Group::own(pg, m.options().timeout());  // one rank: no collective is ever issued
      return;
    }
    static std::atomic<int> count{0};  // every rank creates its savers in the same order
    std::vector<int> ranks(pg->getSize());
    std::iota(ranks.begin(), ranks.end(), 0);
    group = detail::Group::own(fsdp::new_subgroup(pg, ranks, "fsdp-checkpoint-async-saver-" + std::to_string(count++)),
                               m.options().timeout());
  }

  // Waits for the save in flight; returns its error (reported or not), leaving none behind.
  std::exception_ptr collect(bool& reportable) {
    if (worker.joinable()) worker.join();
    reportable = report;
    std::exception_ptr e = error;
    error = nullptr;
    return e;
  }

  AsyncSaveStarted save(const std::string& root, const torch::optim::Optimizer* opt, const SaveOptions& save_options) {
    const auto t0 = Clock::now();
    AsyncSaveStarted out;
    const std::string who = fsdp::detail::error_caller(ErrorContext()
                                                           .api("fsdp::checkpoint::AsyncSaver::save")
                                                           .rank(group.rank())
                                                           .world_size(group.size())
                                                           .path(root + "/" + detail::checkpoint_name(save_options)));
    if (options.if_busy() != IfBusy::kWait) {
      // Every rank must make the same choice, or their saves would pair up wrongly: whether any
      // rank's previous save is still being written is agreed on the caller's thread, over the
      // model's group (where this call sits between steps, like a synchronous save).
      const bool busy = !detail::Group::of(model)
                             .agree("fsdp::checkpoint::AsyncSaver::save: is a save still being written", running())
                             .empty();
      if (busy && options.if_busy() == IfBusy::kSkip) {
        out.skipped = true;
        out.seconds = since(t0);
        return out;
      }
      FSDP_CHECK(!busy, who, ": ", started() ? what : std::string("the previous save"),
                 " is still being written on this rank or another, and this saver does not wait "
                 "(AsyncSaveOptions::if_busy(IfBusy::kThrow)): nothing was started on any rank; call save() again "
                 "later, or wait() first.");
    }
    if (started()) {
      bool reportable = true;
      const std::exception_ptr e = collect(reportable);
      out.waited_seconds = since(t0);
      FSDP_CHECK_IN(context_of(e), !e || !reportable, who,
                    ": nothing was started, because the previous save failed: ", error_text(e));
    }
    auto p = std::make_shared<detail::PreparedSave>();
    p->root = root;
    p->name = detail::checkpoint_name(save_options);
    std::exception_ptr failed;
    try {
      *p = detail::prepare_save(root, model, opt, save_options, group.rank(), group.size());
      take_snapshot(*p);
    } catch (...) {
      failed = std::current_exception();
    }
    // The background thread starts even when this rank could not prepare: its first agreement
    // tells the other ranks, whose saves then fail at once rather than at the timeout.
    what = "the save of '" + root + "/" + p->name + "'";
    result = SaveResult();  // wait() returns this save's result, never an earlier one
    report = failed == nullptr;
    done = false;
    worker = std::thread([this, p, failed, copied = copied] {
      try {
        if (copied) copied->synchronize();
        result = detail::write_and_commit(*p, group, "fsdp::checkpoint::AsyncSaver's background save", [&] {
          if (failed) std::rethrow_exception(failed);
        });
      } catch (...) {
        error = std::current_exception();
      }
      done = true;
    });
    if (failed) std::rethrow_exception(failed);
    out.path = root + "/" + p->name;
    out.snapshot_bytes = p->bytes();
    out.seconds = since(t0);
    return out;
  }

  // Copies the prepared views into the snapshot and points the save at the copies.
  void take_snapshot(detail::PreparedSave& p) {
    std::vector<int64_t> offsets;
    int64_t total = 0;
    for (const auto& kv : p.tensors) {
      offsets.push_back(total);
      total += static_cast<int64_t>(kv.second.nbytes());
    }
    // CUDA tensors are copied into pinned host memory, asynchronously on a side stream that first
    // waits for what the current stream has queued (the values as of this call); the current
    // stream then waits for the copy's end, so that training's later writes come after its reads,
    // and the background thread waits for it before reading the snapshot. save() itself never
    // waits for the GPU. (Tensors on several devices: copied synchronously, one by one.)
    copied.reset();
    std::optional<c10::Device> device;  // of the CUDA tensors (the last one's)
    bool one_device = true;
    for (const auto& kv : p.tensors) {
      if (!kv.second.is_cuda()) continue;
      if (device && *device != kv.second.device()) one_device = false;
      device = kv.second.device();
    }
    const bool cuda = device.has_value();
    const int64_t capacity = total + kSnapshotAlign;  // room to start at an aligned address
    if (!snapshot.defined() || snapshot.numel() < capacity || (cuda && !snapshot.is_pinned())) {
      snapshot = at::Tensor();  // the old one first: never two at once
      snapshot = at::empty({capacity}, at::TensorOptions().dtype(at::kByte).pinned_memory(cuda));
    }
    const auto address = reinterpret_cast<uintptr_t>(snapshot.data_ptr());
    const auto first = static_cast<int64_t>((kSnapshotAlign - address % kSnapshotAlign) % kSnapshotAlign);
    std::optional<c10::Stream> side;
    std::optional<c10::impl::VirtualGuardImpl> cuda_impl;
    if (cuda && one_device) {
      cuda_impl.emplace(device->type());
      side = cuda_impl->getStreamFromGlobalPool(*device);
      c10::Event ready(device->type());
      ready.record(cuda_impl->getStream(*device));
      ready.block(*side);
    }
    for (size_t i = 0; i < p.tensors.size(); ++i) {
      at::Tensor& t = p.tensors[i].second;
      const auto n = static_cast<int64_t>(t.nbytes());
      if (n > 0) {
        // As bytes: back to back, a tensor may start at an address its dtype would not (an int64
        // buffer after an odd number of floats); the bytes' copy does not care.
        const at::Tensor src = t.contiguous().reshape({-1}).view(at::kByte);
        const at::Tensor dst = snapshot.narrow(0, first + offsets[i], n);
        if (side && t.is_cuda()) {
          const c10::StreamGuard on_side(*side);
          dst.copy_(src, /*non_blocking=*/true);
        } else {
          dst.copy_(src);
        }
      }
      // The save writes the tensor's bytes from the snapshot; the view keeps the snapshot alive.
      t = at::from_blob(
          static_cast<uint8_t*>(snapshot.data_ptr()) + first + offsets[i], t.sizes(), [keep = snapshot](void*) {},
          at::TensorOptions().dtype(t.scalar_type()));
    }
    if (side) {
      copied = std::make_shared<c10::Event>(device->type());
      copied->record(*side);
      copied->block(cuda_impl->getStream(*device));
    }
  }

  // A save was started and wait() or save() has not collected it (joined its thread).
  bool started() const { return worker.joinable(); }
  bool running() const { return started() && !done.load(); }
};

AsyncSaver::AsyncSaver(const FSDPModule& model, const AsyncSaveOptions& options)
    : impl_(std::make_unique<Impl>(model, options)) {}

AsyncSaver::~AsyncSaver() {
  if (!impl_ || !impl_->started()) return;
  bool reportable = true;
  const std::exception_ptr e = impl_->collect(reportable);
  if (e && reportable) {
    std::cerr << "fsdp::checkpoint::AsyncSaver (destroyed): " << impl_->what
              << " failed and no save() or wait() received the error: " << error_text(e) << std::endl;
  }
}

AsyncSaveStarted AsyncSaver::save(const std::string& root, const SaveOptions& options) {
  return impl_->save(root, nullptr, options);
}

AsyncSaveStarted AsyncSaver::save(const std::string& root, const torch::optim::Optimizer& optimizer,
                                  const SaveOptions& options) {
  return impl_->save(root, &optimizer, options);
}

SaveResult AsyncSaver::wait() {
  if (impl_->started()) {
    bool reportable = true;
    const std::exception_ptr e = impl_->collect(reportable);
    FSDP_CHECK_IN(context_of(e).api("fsdp::checkpoint::AsyncSaver::wait").world_size(impl_->group.size()),
                  !e || !reportable, impl_->what, " failed: ", error_text(e));
  }
  return impl_->result;
}

bool AsyncSaver::in_flight() const {
  return impl_->started();
}

bool AsyncSaver::writing() const {
  return impl_->running();
}

int64_t AsyncSaver::snapshot_capacity() const {
  return impl_->snapshot.defined() ? impl_->snapshot.numel() : 0;
}

}  // namespace fsdp::checkpoint
