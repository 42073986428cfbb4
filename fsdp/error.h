// fsdp::Error: what libtorch-fsdp throws. A c10::Error (code that catches c10::Error, as LibTorch
// programs do, keeps working) that also says where it arose, as far as the library knows: this
// process's global rank, the operation, the unit, the process group and the peer that stopped
// answering. Its message names them too, with what to do (docs/usage.md, "Errors").
//
//   try {
//     ... training ...
//   } catch (const fsdp::Error& e) {   // the library's own: the message is complete
//     std::cerr << e.what_without_backtrace() << "\n";
//     if (e.peer() >= 0) ... rank e.peer() stopped answering ...
//   } catch (const std::exception& e) {
//     std::cerr << fsdp::error_text(std::current_exception()) << "\n";
//   }
#pragma once

#include "fsdp/export.h"

#include <c10/util/Exception.h>
#include <torch/arg.h>

#include <exception>
#include <string>

FSDP_PUBLIC_BEGIN

namespace fsdp {

/// Where an error arose. Each field is optional: unset where the library does not know it.
struct ErrorContext {
  /// This process's global rank (-1: not known, e.g. before a process group exists).
  TORCH_ARG(int, rank) = -1;
  /// What failed, as the message names it: "reduce-scatter of gradients of unit 'h.3' (...)",
  /// "fsdp::checkpoint::save of 'ckpts/step-000100': writing this rank's file".
  TORCH_ARG(std::string, operation);
  /// The unit it concerns: its module path, or "<root>" (set by a unit's own checks; a failed
  /// collective names its unit inside operation(), "all-gather of unit 'h.3' (...)").
  TORCH_ARG(std::string, unit);
  /// The process group it ran over: "world", "hybrid shard group 1", ...
  TORCH_ARG(std::string, group);
  /// The global rank found to have stopped answering or to be elsewhere (-1: none named).
  TORCH_ARG(int, peer) = -1;
  /// The library call that raised, with which the message begins: "fsdp::fully_shard",
  /// "fsdp::checkpoint::load" ("": the message begins otherwise, e.g. a failed collective's).
  TORCH_ARG(std::string, api);
  /// How many ranks `rank` is one of, where the message says it ("rank 1 of 4"); -1: not said.
  TORCH_ARG(int, world_size) = -1;
  /// This rank's place on a device mesh, "(dp_shard 1, tp 0) of mesh (dp_shard 2, tp 2)", where
  /// it trains on one ("": no mesh).
  TORCH_ARG(std::string, mesh);
  /// The file or directory it concerns, where the caller's name says it: a save's or a load's
  /// "(rank 1 of 4, 'ckpts/step-000100')" ("": none named).
  TORCH_ARG(std::string, path);
};

class Error : public c10::Error {
 public:
  Error(const c10::SourceLocation& source, std::string message, ErrorContext context = {});
  int rank() const { return context_.rank(); }
  const std::string& operation() const { return context_.operation(); }
  const std::string& unit() const { return context_.unit(); }
  const std::string& group() const { return context_.group(); }
  int peer() const { return context_.peer(); }
  const std::string& api() const { return context_.api(); }
  const ErrorContext& where() const { return context_; }

 private:
  ErrorContext context_;
};

/// The text of an exception without LibTorch's C++ backtrace: a c10::Error's (fsdp::Error's)
/// what_without_backtrace(), another std::exception's what(), or "an unknown exception".
std::string error_text(const std::exception_ptr& error);
std::string error_text(const std::exception& error);

}  // namespace fsdp

FSDP_PUBLIC_END
