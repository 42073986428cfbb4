// The tensors inside a forward's arguments and outputs: a tensor, and the tensors in vectors,
// optionals, pairs and tuples of them, in order. Anything else holds none. Used where the library
// must find every tensor a forward takes or returns (hooking a unit's outputs, the inputs and
// outputs of fsdp::activation_checkpoint) and put others in their place, keeping the structure.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace fsdp::detail {

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
/// Anything else (numbers, strings, options structs): no tensor.
template <typename T, typename F>
void visit_tensors(T&, F&&) {}

/// The tensors of `x`, in order.
template <typename T>
std::vector<at::Tensor> tensors_of(T& x) {
  std::vector<at::Tensor> out;
  visit_tensors(x, [&](at::Tensor& t) { out.push_back(t); });
  return out;
}

}  // namespace fsdp::detail
