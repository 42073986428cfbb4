// fsdp::checkpoint::save: each rank writes its rows into its own file in the staging directory;
// rank 0 gathers each rank's list of chunks (not the data), writes the manifest and commits
// (internal/save_steps.h), all on the caller's thread over the model's process group (a
// tensor-parallel model's: the mesh's world).
#include "checkpoint/checkpoint.h"

#include "checkpoint/internal/save_steps.h"

#include <chrono>
#include <string>

namespace fsdp::checkpoint {
namespace {

SaveResult save_checkpoint(const std::string& root, const FSDPModule& model, const torch::optim::Optimizer* opt,
                           const SaveOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  detail::PreparedSave prepared;  // named now, for the errors of the first phase
  prepared.root = root;
  prepared.name = detail::checkpoint_name(options);
  // Prepared inside the first agreement: a rank that cannot (an unsupported optimizer) fails
  // every rank before anything is on disk.
  const detail::Group group = detail::Group::of(model);
  SaveResult r = detail::write_and_commit(prepared, group, "fsdp::checkpoint::save", [&] {
    prepared = detail::prepare_save(root, model, opt, options, group.rank(), group.size());
  });
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace

SaveResult save(const std::string& root, const FSDPModule& model, const SaveOptions& options) {
  return save_checkpoint(root, model, nullptr, options);
}

SaveResult save(const std::string& root, const FSDPModule& model, const torch::optim::Optimizer& optimizer,
                const SaveOptions& options) {
  return save_checkpoint(root, model, &optimizer, options);
}

}  // namespace fsdp::checkpoint
