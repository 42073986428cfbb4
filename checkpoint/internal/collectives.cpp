#include "checkpoint/internal/collectives.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <functional>

namespace fsdp::checkpoint::detail {
namespace {

void wait(const c10::intrusive_ptr<c10d::Work>& work, const c10d::ProcessGroup& pg, std::chrono::milliseconds timeout,
          const std::string& what) {
  try {
    work->wait(timeout);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "fsdp::checkpoint (rank ", pg.getRank(), " of ", pg.getSize(), "): ", what,
                " failed or timed out after ", timeout.count(), " ms (", e.what(),
                "). Another rank stopped or is not saving: every rank must call the same save.");
  }
}

}  // namespace

void agree(const Group& group, const std::string& call, const std::string& where, const std::string& phase,
           const std::string& consequence, const std::function<void()>& fn) {
  std::string error;
  try {
    fn();
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = e.what();
  }
  at::Tensor failed = at::full({1}, error.empty() ? 0 : 1, at::kLong);
  if (group.model != nullptr) {
    group.model->all_reduce(failed, c10d::ReduceOp::MAX, call + ": " + phase);
  } else if (group.size() > 1) {  // a side group: only the saver's background thread uses it
    // With the flag, the call's hash and its negation: after a MAX, the ranks were at the same
    // call only if both come back unchanged (a save of another name on some rank would otherwise
    // pair with this one).
    const auto hash = static_cast<int64_t>(std::hash<std::string>{}(call + ": " + phase) >> 2);
    failed = at::tensor({failed.item<int64_t>(), hash, -hash}, at::kLong);
    std::vector<at::Tensor> t{failed};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    o.timeout = group.timeout;
    wait(group.pg->getBackend(c10::DeviceType::CPU)->allreduce(t, o), *group.pg, group.timeout, call + ": " + phase);
    TORCH_CHECK(failed[1].item<int64_t>() == hash && failed[2].item<int64_t>() == -hash, where,
                ": the ranks are not at the same call (", call, ": ", phase,
                " here): every rank must save the same root and name. Nothing was committed.");
    failed = failed.narrow(0, 0, 1);
  }
  TORCH_CHECK(error.empty(), where, ": ", phase, " failed on this rank: ", error);
  TORCH_CHECK(failed.item<int64_t>() == 0, where, ": ", phase, " failed on another rank (its error says why); ",
              consequence, ".");
}

std::vector<std::string> gather_to_rank0(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::string& text,
                                         std::chrono::milliseconds timeout, const std::string& what) {
  const int W = pg->getSize(), r = pg->getRank();
  if (W == 1) return {text};
  auto backend = pg->getBackend(c10::DeviceType::CPU);
  // The lengths first (one number per rank, to every rank), then the texts padded to the longest,
  // to rank 0 only.
  std::vector<at::Tensor> len_in{at::full({1}, static_cast<int64_t>(text.size()), at::kLong)};
  std::vector<std::vector<at::Tensor>> len_out(1);
  for (int i = 0; i < W; ++i) len_out[0].push_back(at::empty({1}, at::kLong));
  c10d::AllgatherOptions ag;
  ag.timeout = timeout;
  wait(backend->allgather(len_out, len_in, ag), *pg, timeout, what);
  int64_t longest = 0;
  for (const auto& l : len_out[0]) longest = std::max(longest, l.item<int64_t>());
  std::vector<at::Tensor> in{at::zeros({std::max<int64_t>(longest, 1)}, at::kByte)};
  std::memcpy(in[0].data_ptr(), text.data(), text.size());
  std::vector<std::vector<at::Tensor>> out;
  if (r == 0) {
    out.emplace_back();
    for (int i = 0; i < W; ++i) out[0].push_back(at::empty_like(in[0]));
  }
  c10d::GatherOptions go;
  go.rootRank = 0;
  go.timeout = timeout;
  wait(backend->gather(out, in, go), *pg, timeout, what);
  std::vector<std::string> texts;
  if (r != 0) return texts;
  for (int i = 0; i < W; ++i) {
    const auto n = static_cast<size_t>(len_out[0][i].item<int64_t>());
    texts.emplace_back(static_cast<const char*>(out[0][i].data_ptr()), n);
  }
  return texts;
}

}  // namespace fsdp::checkpoint::detail
