// Every kind of collective and cross-rank agreement the library issues, one code each, and the
// fingerprint of a call's arguments. A rank at one call then never pairs with a rank at another
// unnoticed: the agreement (Comm::agree) compares the code and the fingerprint, and the call log
// (CallLog) hashes the codes of the collectives between two agreements. Internal to the library.
#pragma once

#include <cstdint>
#include <string>

namespace fsdp::detail {

/// The registry of call codes. A new agreement or collective takes a new number here; numbers are
/// exchanged between ranks of one job only, so they may change between versions.
enum class Call : int64_t {
  // The collectives of the call log (Comm::record) and of verify_collectives.
  kAllGather = 1,
  kReduceScatter = 2,
  kAllReduce = 3,
  kBroadcast = 4,
  // The step's boundaries (RunState::agree, docs/design.md "Ranks on the same path").
  kForward = 101,
  kBackwardBegin = 102,
  kBackwardEnd = 103,
  kModelCollective = 104,  ///< a collective of the model's own functions: clipping, the scaler, a load's totals
  kFullStateDict = 105,
  kModelCheck = 106,       ///< fully_shard's model check (internal/model_check.cpp)
  kDeviceMesh = 107,       ///< every rank builds a DeviceMesh of the same dimensions (fsdp/device_mesh.cpp)
  kOuterStep = 108,        ///< LocalSGD / DiLoCo: the same settings everywhere, the same outer step across replicas
  kReduceGradients = 109,  ///< FSDPModule::reduce_gradients (a pipeline stage's reduction after its last backward)
  // fsdp::all_reduce over a process group (metrics).
  kUserAllReduce = 201,
  // A phase of a checkpoint's save or load succeeded on every rank (checkpoint/internal/collectives.cpp).
  kCheckpointPhase = 301,
};

/// FNV-1a over 64-bit words and strings: what a call's arguments are, in one number.
class Fingerprint {
 public:
  Fingerprint& add(uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h_ ^= (v >> (8 * i)) & 0xff;
      h_ *= 1099511628211ull;
    }
    return *this;
  }
  Fingerprint& add(int64_t v) { return add(static_cast<uint64_t>(v)); }
  Fingerprint& add(int v) { return add(static_cast<uint64_t>(static_cast<int64_t>(v))); }
  Fingerprint& add(Call c) { return add(static_cast<uint64_t>(c)); }
  Fingerprint& add(const std::string& s) {
    uint64_t t = kBasis;
    for (unsigned char c : s) {
      t ^= c;
      t *= 1099511628211ull;
    }
    return add(t);
  }
  uint64_t value() const { return h_; }

 private:
  static constexpr uint64_t kBasis = 1469598103934665603ull;
  uint64_t h_ = kBasis;
};

}  // namespace fsdp::detail
