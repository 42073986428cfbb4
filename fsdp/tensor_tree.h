// The tensors inside a forward's arguments and outputs: a tensor, and the tensors in vectors,
// optionals, pairs and tuples of them, in order. Anything else holds none. Used where the library
// must find every tensor a forward takes or returns (hooking a unit's outputs, the inputs and
// outputs of fsdp::activation_checkpoint) and put others in their place, keeping the structure.
#pragma once

#include "fsdp/export.h"

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::detail {

/// Anything else (numbers, strings, options structs): no tensor. Declared first, so that the
/// tuple and pair overloads below find it for their non-tensor elements.
template <typename T, typename F>
void visit_tensors(T&, F&&) {}

template <typename F>
void visit_tensors(at::Tensor& t, F&& f) {
  f(t);
}
template <typename F>
void visit_tensors(std::vector<at::Tensor>& ts, F&& f) {
  for (auto& t : ts) f(t);
}
template <typename F>
void visit_tensors(std::optional<at::Tensor>& t, F&& f) {
  if (t.has_value()) f(*t);
}
template <typename A, typename B, typename F>
void visit_tensors(std::pair<A, B>& p, F&& f);
template <typename... Ts, typename F>
void visit_tensors(std::tuple<Ts...>& t, F&& f) {
  std::apply([&](auto&... e) { (visit_tensors(e, f), ...); }, t);  // a comma fold: in order
}
template <typename A, typename B, typename F>
void visit_tensors(std::pair<A, B>& p, F&& f) {
  visit_tensors(p.first, f);
  visit_tensors(p.second, f);
}
/// Whether every tensor a value of type T holds is one visit_tensors sees: T is a tensor, a vector
/// or optional of tensors, a number, an enum or a string, or a pair or tuple of such. A struct,
/// array or map of tensors is not (its tensors would be invisible).
template <typename T>
struct is_tensor_tree
    : std::bool_constant<std::is_arithmetic_v<T> || std::is_enum_v<T> || std::is_same_v<T, std::string> ||
                         std::is_same_v<T, at::Tensor> || std::is_same_v<T, std::vector<at::Tensor>> ||
                         std::is_same_v<T, std::optional<at::Tensor>>> {};
template <typename A, typename B>
struct is_tensor_tree<std::pair<A, B>> : std::bool_constant<is_tensor_tree<A>::value && is_tensor_tree<B>::value> {};
template <typename... Ts>
struct is_tensor_tree<std::tuple<Ts...>> : std::bool_constant<(is_tensor_tree<Ts>::value && ...)> {};

/// The tensors of `x`, in order.
template <typename T>
std::vector<at::Tensor> tensors_of(T& x) {
  std::vector<at::Tensor> out;
  visit_tensors(x, [&](at::Tensor& t) { out.push_back(t); });
  return out;
}

}  // namespace fsdp::detail

FSDP_PUBLIC_END
