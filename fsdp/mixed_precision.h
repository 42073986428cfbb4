// Mixed precision (PyTorch FSDP2's MixedPrecisionPolicy): the model keeps its parameters, and the
// optimizer its state, in the dtype the model was built with (fp32, the master weights), sharded;
// each unit is all-gathered and computes in `param_dtype` (bf16, fp16), and its gradients are
// reduce-scattered in `reduce_dtype` and land on the shards in the master dtype.
//
//   fsdp::FullyShardOptions().mixed_precision(
//       fsdp::MixedPrecisionPolicy().param_dtype(torch::kBFloat16))   // reduce in fp32
//   blocks[0]->set_mixed_precision(fsdp::MixedPrecisionPolicy());     // this unit stays fp32
//
// Gathering casts this rank's rows first, so the all-gather moves param_dtype bytes; the cast copy
// of a unit exists only while it is gathered. fp16 needs loss scaling: fsdp::optim::ShardedGradScaler.
#pragma once

#include "fsdp/export.h"
#include "fsdp/tensor_tree.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstddef>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp {

struct MixedPrecisionPolicy {
  /// The dtype of the gathered parameters, hence of the unit's forward and backward (and of its
  /// gradients before reduction). Unset: the parameters' own dtype (no mixed precision).
  TORCH_ARG(std::optional<at::ScalarType>, param_dtype) = std::nullopt;
  /// The dtype gradients are reduced in. Unset: the parameters' own dtype (fp32 for an fp32 model),
  /// so that the sum over ranks loses nothing; kBFloat16 halves the reduce-scatter's bytes.
  TORCH_ARG(std::optional<at::ScalarType>, reduce_dtype) = std::nullopt;
  /// The dtype the unit's floating-point outputs are cast to (unset: left as computed).
  TORCH_ARG(std::optional<at::ScalarType>, output_dtype) = std::nullopt;
  /// Cast the unit's floating-point tensor inputs to param_dtype before its forward (FSDP2's
  /// default), so that an fp32 activation meets bf16 weights as bf16. Integer inputs (token ids)
  /// are left alone, and so are inputs taken by non-const reference.
  TORCH_ARG(bool, cast_forward_inputs) = true;

 public:
  /// Whether any dtype is set (the model check describes only such a policy).
  bool any_dtype() const { return param_dtype_ || reduce_dtype_ || output_dtype_; }
};

/// "param_dtype=BFloat16 reduce_dtype=- output_dtype=- cast_forward_inputs=1": logs and messages.
std::string to_string(const MixedPrecisionPolicy& policy);

namespace detail {

// The casts at a unit's forward boundary, applied to whatever Impl::forward takes and returns:
// floating-point tensors are cast, everything else passes through untouched.
inline at::Tensor cast_floating(const at::Tensor& t, std::optional<at::ScalarType> dtype) {
  if (!dtype || !t.defined() || !t.is_floating_point() || t.scalar_type() == *dtype) return t;
  return t.to(*dtype);
}

/// What a unit's forward casts (its floating-point inputs to `input`, its outputs to `output`),
/// and what it saw of its tensor arguments: the first floating-point one, after the cast, of
/// another dtype than the unit computes in (`compute`). LibTorch's operators refuse such a mix,
/// and the error then says why (Unit's forward errors, sharded.cpp).
struct ForwardCasts {
  std::optional<at::ScalarType> input, output;
  at::ScalarType compute = at::kFloat;
  std::optional<at::ScalarType> other_input;
  void see(const at::Tensor& t) {
    if (!other_input && t.defined() && t.is_floating_point() && t.scalar_type() != compute) {
      other_input = t.scalar_type();
    }
  }
};

/// An input `x` for a forward parameter of type `P`: a tensor is cast unless the callee takes it by
/// non-const reference (it may write into it); anything else is forwarded. Decided by the callee's
/// parameter, never by how the caller passes the tensor (model(x) and model(x.clone()) alike).
template <typename P, typename T>
decltype(auto) cast_input(T&& x, ForwardCasts& casts) {
  constexpr bool mutable_ref = std::is_lvalue_reference_v<P> && !std::is_const_v<std::remove_reference_t<P>>;
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor> && !mutable_ref) {
    at::Tensor cast = cast_floating(x, casts.input);
    casts.see(cast);
    return cast;
  } else {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) casts.see(x);
    return std::forward<T>(x);
  }
}

/// The parameter types of Impl::forward when it is one function taking N arguments; otherwise (an
/// overloaded or template forward) `const at::Tensor&` for each, so that every tensor is cast.
template <size_t>
using const_tensor_ref = const at::Tensor&;
template <typename Impl, size_t N, typename = void>
struct forward_params {
  template <size_t... I>
  static auto all_const(std::index_sequence<I...>) -> std::tuple<const_tensor_ref<I>...>;
  using type = decltype(all_const(std::make_index_sequence<N>()));
};
template <typename F, size_t N>
struct params_of_member {
  using type = void;
};
template <typename C, typename R, typename... Ps, size_t N>
struct params_of_member<R (C::*)(Ps...), N> {
  using type = std::conditional_t<sizeof...(Ps) == N, std::tuple<Ps...>, void>;
};
template <typename C, typename R, typename... Ps, size_t N>
struct params_of_member<R (C::*)(Ps...) const, N> {
  using type = std::conditional_t<sizeof...(Ps) == N, std::tuple<Ps...>, void>;
};
template <typename Impl, size_t N>
struct forward_params<Impl, N,
                      std::enable_if_t<!std::is_void_v<typename params_of_member<decltype(&Impl::forward), N>::type>>> {
  using type = typename params_of_member<decltype(&Impl::forward), N>::type;
};

/// Calls impl.forward(args...) with each argument cast as cast_input says for its parameter.
template <typename Impl, typename... Args, size_t... I>
decltype(auto) forward_with_casts(Impl& impl, ForwardCasts& casts, std::index_sequence<I...>, Args&&... args) {
  using Ps = typename forward_params<Impl, sizeof...(Args)>::type;
  return impl.forward(cast_input<std::tuple_element_t<I, Ps>>(std::forward<Args>(args), casts)...);
}

/// An output: its tensors (fsdp/tensor_tree.h: also in vectors, optionals, pairs and tuples) are
/// cast in place.
template <typename T>
void cast_output(T& out, std::optional<at::ScalarType> dtype) {
  visit_tensors(out, [&](at::Tensor& t) { t = cast_floating(t, dtype); });
}

}  // namespace detail
}  // namespace fsdp

FSDP_PUBLIC_END
