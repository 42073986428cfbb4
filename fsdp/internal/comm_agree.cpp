// The communication context's agreement ("every rank of this group is at call C with payload
// hash H") and its exchange of strings between ranks (fsdp/internal/comm.h: Comm::agree,
// Comm::exchange_strings): both small collectives on the CPU backend, waited for like every other.
#include "fsdp/internal/check.h"
#include "fsdp/internal/comm.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <sstream>

namespace fsdp::detail {
namespace {

// An agreement's words per rank: magic, call, payload, vote.
constexpr int64_t kMagic = 0x46534450434b32;  // "FSDPCK2": an agreement paired with anything else shows
constexpr int64_t kAgreeWords = 4;

}  // namespace

void Comm::gather_small(at::Tensor& out, at::Tensor& in, const char* op, const std::string& what) const {
  Pending p = launch(op, what, in, [&](c10d::Backend& b, bool /*async_op*/) {
    c10d::AllgatherOptions opts;
    opts.timeout = timeout_;
    return b._allgather_base(out, in, opts);
  });
  wait(p);
}

std::vector<int64_t> Comm::agree(Call call, uint64_t payload, const std::string& what, const Details& details,
                                 int64_t vote, const Explain& explain) {
  if (world_size_ == 1) return {vote};
  ++stats().checks;
  const int64_t W = world_size_;
  at::Tensor mine = at::empty({kAgreeWords}, at::kLong);
  int64_t* m = mine.data_ptr<int64_t>();
  m[0] = kMagic;
  m[1] = static_cast<int64_t>(call);
  m[2] = static_cast<int64_t>(payload);
  m[3] = vote;
  at::Tensor all = at::empty({W * kAgreeWords}, at::kLong);
  const std::string check = "the cross-rank check before " + what;
  gather_small(all, mine, "agreement", check);
  const int64_t* a = all.data_ptr<int64_t>();
  std::vector<int64_t> votes(static_cast<size_t>(W));
  bool same = true, all_agreeing = true, same_call = true;
  for (int64_t q = 0; q < W; ++q) {
    const int64_t* w = a + q * kAgreeWords;
    all_agreeing = all_agreeing && w[0] == kMagic;
    same_call = same_call && w[1] == m[1];
    same = same && w[0] == kMagic && w[1] == m[1] && w[2] == m[2];
    votes[static_cast<size_t>(q)] = w[3];
  }
  if (same) return votes;
  const std::string advice =
      "\nEvery rank must run the same sequence of forwards and backwards through the wrapped model and the same "
      "library calls (the same micro-batches, gradient sync on or off alike, clipping on every rank or none).";
  const std::string tip = verify_ ? "" : " For the first collective that differs, run with FSDP_VERIFY_COLLECTIVES=1.";
  std::ostringstream os;
  if (!all_agreeing) {
    // A rank was inside another collective of the same size: a second exchange would not pair
    // with what it does next, so this rank stops here, naming those ranks.
    os << "\n  global ranks not at a cross-rank check of this library (inside another collective):";
    for (int64_t q = 0; q < W; ++q) {
      if (a[q * kAgreeWords] != kMagic) os << ' ' << group_.global_ranks[static_cast<size_t>(q)];
    }
    os << "\n  global rank " << global_rank_ << ": " << what;
    FSDP_CHECK_IN(error_context(what), false, "fsdp: the ranks took different paths through the program (seen on ",
                  where(), "; no collective of mismatched size was issued):", os.str(), advice, tip);
  }
  // Every rank saw the same gathered words, so every rank is here: one exchange brings each rank's
  // description, for an error that says what each did. The details are put into words only now:
  // the agreements that hold, every step, cost no text.
  const std::vector<std::string> descriptions = exchange_strings(details ? what + details() : what, check);
  if (same_call && explain) explain(descriptions);  // throws its own error (returning leaves ours)
  std::map<std::string, std::vector<int>> by_call;
  std::vector<std::string> order;
  for (int64_t q = 0; q < W; ++q) {
    const std::string& d = descriptions[static_cast<size_t>(q)];
    if (by_call.count(d) == 0) order.push_back(d);
    by_call[d].push_back(group_.global_ranks[static_cast<size_t>(q)]);
  }
  for (const auto& d : order)
    os << "\n  global rank" << (by_call[d].size() > 1 ? "s " : " ") << list_ranks(by_call[d]) << ": " << d;
  FSDP_CHECK_IN(error_context(what), false, "fsdp: the ranks took different paths through the program (seen on ",
                where(), "; no collective of mismatched size was issued):", os.str(), advice, tip);
  TORCH_INTERNAL_ASSERT(false, "unreachable");
}

std::vector<std::string> Comm::exchange_strings(const std::string& text, const std::string& what, int root) {
  if (world_size_ == 1) return {text};
  const int64_t W = world_size_;
  at::Tensor len = at::full({1}, static_cast<int64_t>(text.size()), at::kLong);
  at::Tensor lens = at::empty({W}, at::kLong);
  gather_small(lens, len, "exchange", what);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t longest = std::max<int64_t>(1, *std::max_element(lp, lp + W));
  at::Tensor mine = at::zeros({longest}, at::kByte);
  std::memcpy(mine.data_ptr(), text.data(), text.size());
  at::Tensor all;
  if (root < 0) {
    all = at::empty({W * longest}, at::kByte);
    gather_small(all, mine, "exchange", what);
  } else {
    // To one rank only (a checkpoint's manifest parts): the others receive nothing.
    std::vector<std::vector<at::Tensor>> out(1);
    if (rank_ == root) {
      all = at::empty({W * longest}, at::kByte);
      for (int64_t q = 0; q < W; ++q) out[0].push_back(all.narrow(0, q * longest, longest));
    } else {
      out.clear();
    }
    std::vector<at::Tensor> in{mine};
    Pending p = launch("gather", what, mine, [&](c10d::Backend& b, bool /*async_op*/) {
      c10d::GatherOptions opts;
      opts.rootRank = root;
      opts.timeout = timeout_;
      return b.gather(out, in, opts);
    });
    wait(p);
    if (rank_ != root) return {};
  }
  std::vector<std::string> texts;
  texts.reserve(static_cast<size_t>(W));
  const char* base = static_cast<const char*>(all.data_ptr());
  for (int64_t q = 0; q < W; ++q) texts.emplace_back(base + q * longest, static_cast<size_t>(lp[q]));
  return texts;
}

}  // namespace fsdp::detail
