// fsdp::Sharded<Impl>: marks a module (typically a transformer block) as one sharding unit.
//
//   struct GPTImpl : torch::nn::Module {
//     GPTImpl() { for (...) blocks.push_back(register_module("h" + i, fsdp::Sharded<BlockImpl>(cfg))); }
//     std::vector<fsdp::Sharded<BlockImpl>> blocks;
//   };
//
// ShardedImpl<Impl> derives from the user's Impl, so every parameter keeps its exact name, and its
// forward() hides Impl::forward: gather the unit's parameters, run Impl::forward, free them again
// and hook the outputs so that backward gathers them once more. LibTorch modules have no forward
// hooks and forward() is not virtual, so interception by type is the one way in.
// Before fsdp::fully_shard has seen the model, a ShardedImpl behaves exactly like Impl.
#pragma once

#include "fsdp/activation_checkpoint.h"
#include "fsdp/export.h"
#include "fsdp/mixed_precision.h"
#include "fsdp/options.h"
#include "fsdp/tensor_tree.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp {

namespace detail {

class FSDP_HIDDEN Unit;
/// `member`: which of the unit's modules runs (0 unless modules share the unit, share_unit_with).
ForwardCasts unit_pre_forward(Unit& unit, int member);
/// Whether fully_shard made the unit checkpoint its activations.
bool unit_checkpoints_activations(const Unit& unit);
/// How a checkpointed unit's errors name it: "fsdp::activation_checkpoint of unit 'h.0'" (null:
/// a unit not sharded yet).
std::string checkpoint_label(const Unit* unit);
/// A checkpointed unit whose forward returns a type whose tensors cannot be seen: refused.
[[noreturn]] void refuse_checkpointed_output(const Unit* unit);
/// A checkpointed forward of `unit` begins (null: a module not sharded yet): what its checkpoint
/// calls when its recompute's backward has accumulated its gradients, or when it is freed without
/// one (null for none).
std::function<void(bool)> unit_checkpoint_began(Unit* unit);
void unit_post_forward(Unit& unit, int member, const std::vector<at::Tensor>& outputs);
/// Adds to an error raised in the unit's forward by LibTorch's operators or the user's code (not
/// by the library: an fsdp::Error says enough) which unit, rank and dtypes it was, unless an inner
/// unit did already, and the remedy when the forward saw a dtype its unit does not compute in.
void name_unit_in_error(const Unit& unit, const ForwardCasts& casts, c10::Error& e);
/// Runs the forward `fn` of `unit`, naming the unit in an error it raises (name_unit_in_error).
template <typename Fn>
auto forward_naming_unit(const Unit& unit, const ForwardCasts& casts, Fn&& fn) {
  try {
    return fn();
  } catch (c10::Error& e) {
    name_unit_in_error(unit, casts, e);  // e.g. a dtype mismatch between units
    throw;
  }
}
}  // namespace detail

namespace detail {
struct FSDP_HIDDEN Access;
}  // namespace detail

/// The non-template part of every sharded module: its per-unit settings, and the unit it belongs
/// to once sharded.
class ShardedUnit {
 public:
  virtual ~ShardedUnit() = default;
  /// Whether this module is sharded (by fsdp::fully_shard, or as it was built in a ShardingScope).
  bool is_sharded() const { return fsdp_unit_ != nullptr; }

  /// This unit's strategy, overriding FullyShardOptions::strategy; set before fsdp::fully_shard:
  ///   blocks.back()->set_sharding_strategy(fsdp::ShardingStrategy::kShardGradOp);
  void set_sharding_strategy(ShardingStrategy strategy);
  const std::optional<ShardingStrategy>& sharding_strategy() const { return strategy_; }
  /// This unit's mixed precision, overriding FullyShardOptions::mixed_precision; set before
  /// fsdp::fully_shard. MixedPrecisionPolicy() keeps a unit in the model's dtype (fsdp/mixed_precision.h):
  ///   blocks.back()->set_mixed_precision(fsdp::MixedPrecisionPolicy().param_dtype(torch::kBFloat16));
  void set_mixed_precision(const MixedPrecisionPolicy& policy);
  const std::optional<MixedPrecisionPolicy>& mixed_precision() const { return mixed_precision_; }
  /// Activation checkpointing of this unit (fsdp/activation_checkpoint.h), overriding
  /// FullyShardOptions::activation_checkpointing_every: its forward keeps no activations and runs
  /// again in backward, while the unit is gathered for its backward (no extra all-gather). Only
  /// in training with gradients on (eval and torch::NoGradGuard run it plainly). Set before
  /// fsdp::fully_shard; before it (or in a model never wrapped) the module checkpoints itself too.
  /// A unit that contains other units cannot be checkpointed (their forwards would run again in
  /// backward): checkpoint the inner ones.
  void set_activation_checkpointing(bool on);
  const std::optional<bool>& activation_checkpointing() const { return activation_checkpointing_; }
  /// Makes this module part of the unit of `first`: one unit over sibling modules, as FSDP2's
  /// fully_shard([norm, output]), gathered once before the first of them runs in a forward and
  /// resharded after the last has run; each parameter keeps its module's name. The way to make a
  /// model's final norm and head one unit, or a tied embedding and head (a parameter shared by two
  /// units is refused):
  ///   lm_head->share_unit_with(*ln_f);
  /// Call before fsdp::fully_shard, on modules of the same model; in an fsdp::ShardingScope, once
  /// both are built (their shards are then gathered once and sharded again as one unit). The
  /// unit's settings (strategy, mixed precision, activation checkpointing) are its modules': set
  /// them on one, or the same on each.
  void share_unit_with(ShardedUnit& first);
  /// The module whose unit this one joined (share_unit_with), or null.
  ShardedUnit* shares_unit_of() const;

 protected:
  /// Runs `forward(casts, args...)` between the unit's pre- and post-forward steps, checkpointed
  /// when the unit is (and `training`, with gradients on). `forward` casts its floating-point
  /// tensor arguments to casts.input (when set).
  template <typename Fn, typename... Args>
  auto run_unit(bool training, Fn&& forward, Args&&... args) {
    detail::ForwardCasts casts;
    const bool checkpoint = training && c10::GradMode::is_enabled() && checkpoints_activations();
    auto run = [&] {
      using Out = std::decay_t<decltype(forward(casts, args...))>;
      if constexpr (!detail::is_tensor_tree<Out>::value) {  // its output's tensors cannot be seen
        if (checkpoint) detail::refuse_checkpointed_output(fsdp_unit_.get());
        return Out(forward(casts, std::forward<Args>(args)...));
      } else {
        if (!checkpoint) return Out(forward(casts, std::forward<Args>(args)...));
        // The casts are the recompute's too: copied, as everything the recompute runs.
        return Out(detail::activation_checkpoint_labelled(
            detail::checkpoint_label(fsdp_unit_.get()), detail::unit_checkpoint_began(fsdp_unit_.get()),
            [forward, casts](auto&... a) mutable { return forward(casts, a...); }, std::forward<Args>(args)...));
      }
    };
    if (!fsdp_unit_) return run();
    casts = detail::unit_pre_forward(*fsdp_unit_, fsdp_member_);
    auto out = detail::forward_naming_unit(*fsdp_unit_, casts, run);
    detail::cast_output(out, casts.output);
    detail::unit_post_forward(*fsdp_unit_, fsdp_member_, detail::tensors_of(out));
    return out;
  }

  std::shared_ptr<detail::Unit> fsdp_unit_;  // null until sharded (set through detail::Access)
  int fsdp_member_ = 0;                      // this module's index among its unit's modules
  std::optional<ShardingStrategy> strategy_;
  std::optional<MixedPrecisionPolicy> mixed_precision_;
  std::optional<bool> activation_checkpointing_;

 private:
  friend struct detail::Access;
  std::weak_ptr<torch::nn::Module> unit_of_;  // share_unit_with's `first`
  /// Once sharded, what fully_shard resolved for the unit; before, this module's own setting.
  bool checkpoints_activations() const {
    return fsdp_unit_ ? detail::unit_checkpoints_activations(*fsdp_unit_) : activation_checkpointing_.value_or(false);
  }
};

namespace detail {
void unit_zero_grad(Unit& unit);
void unit_to(Unit& unit, const std::optional<at::Device>& device, const std::optional<at::ScalarType>& dtype);

// &Impl::forward when it names one function, else void.
template <typename T, typename = void>
struct forward_ptr {
  using type = void;
};
template <typename T>
struct forward_ptr<T, std::void_t<decltype(&T::forward)>> {
  using type = decltype(&T::forward);
};
}  // namespace detail

namespace detail {
/// What every sharded module overrides of torch::nn::Module: zero_grad reports gradients
/// accumulated without sync and never reduced; to() refuses a change of dtype or device once the
/// unit is sharded. Before fsdp::fully_shard both behave as Impl's.
template <typename Impl>
class UnitModule : public Impl, public ShardedUnit {
 public:
  using Impl::Impl;
  void zero_grad(bool set_to_none = true) override {
    if (fsdp_unit_) unit_zero_grad(*fsdp_unit_);
    Impl::zero_grad(set_to_none);
  }
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override {
    if (!fsdp_unit_) return Impl::to(device, dtype, non_blocking);
    unit_to(*fsdp_unit_, device, dtype);
  }
  void to(torch::Dtype dtype, bool non_blocking = false) override {
    if (!fsdp_unit_) return Impl::to(dtype, non_blocking);
    unit_to(*fsdp_unit_, std::nullopt, dtype);
  }
  void to(torch::Device device, bool non_blocking = false) override {
    if (!fsdp_unit_) return Impl::to(device, non_blocking);
    unit_to(*fsdp_unit_, device, std::nullopt);
  }
};
}  // namespace detail

/// Impl with its forward intercepted. When Impl has a single forward(), the wrapper's forward has
/// exactly its signature (so ModuleList, Sequential and AnyModule can hold it); otherwise forward is
/// a template that accepts whatever Impl::forward does.
template <typename Impl, typename F = typename detail::forward_ptr<Impl>::type>
class ShardedImpl : public detail::UnitModule<Impl> {
 public:
  using detail::UnitModule<Impl>::UnitModule;
  template <typename... Args>
  auto forward(Args&&... args) {
    return this->run_unit(
        this->is_training(),
        [this](detail::ForwardCasts& casts, auto&&... a) {
          // Through Impl&: Impl's own forward, not this wrapper's.
          return detail::forward_with_casts(static_cast<Impl&>(*this), casts, std::index_sequence_for<Args...>(),
                                            std::forward<decltype(a)>(a)...);
        },
        std::forward<Args>(args)...);
  }
};

template <typename Impl, typename C, typename R, typename... A>
class ShardedImpl<Impl, R (C::*)(A...)> : public detail::UnitModule<Impl> {
 public:
  using detail::UnitModule<Impl>::UnitModule;
  R forward(A... args) {
    return this->run_unit(
        this->is_training(),
        [this](detail::ForwardCasts& casts, auto&&... a) -> R {
          return this->Impl::forward(detail::cast_input<A>(std::forward<decltype(a)>(a), casts)...);
        },
        std::forward<A>(args)...);
  }
};

/// The unit behind a module held as a plain torch::nn::Module pointer (a Sequential's or
/// ModuleList's entry, a child from named_children()), for its per-unit settings:
///   fsdp::as_unit(seq->ptr(2)).set_sharding_strategy(fsdp::ShardingStrategy::kNoShard);
/// Throws when the module is not an fsdp::Sharded unit.
ShardedUnit& as_unit(const std::shared_ptr<torch::nn::Module>& module);

namespace detail {
/// Inside an fsdp::ShardingScope: shards the unit just built (see sharding_scope.h).
void on_unit_constructed(torch::nn::Module& module, ShardedUnit& unit);
}  // namespace detail

/// Module holder for a sharded Impl, used like any LibTorch holder: Sharded<BlockImpl>(args...).
/// Built inside an fsdp::ShardingScope, the unit is sharded as soon as Impl's constructor returns.
template <typename Impl>
class Sharded : public torch::nn::ModuleHolder<ShardedImpl<Impl>> {
  using Base = torch::nn::ModuleHolder<ShardedImpl<Impl>>;

 public:
  using Base::Base;  // nullptr, and an existing std::shared_ptr<ShardedImpl<Impl>>
  Sharded() : Base() { detail::on_unit_constructed(**this, **this); }
  template <typename Head, typename... Tail,
            typename = std::enable_if_t<!(torch::detail::is_module_holder_of<Head, ShardedImpl<Impl>>::value &&
                                          (sizeof...(Tail) == 0))>>
  explicit Sharded(Head&& head, Tail&&... tail) : Base(std::forward<Head>(head), std::forward<Tail>(tail)...) {
    detail::on_unit_constructed(**this, **this);
  }
};

}  // namespace fsdp

FSDP_PUBLIC_END
