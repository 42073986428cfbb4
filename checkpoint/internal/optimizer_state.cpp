#include "checkpoint/internal/optimizer_state.h"
#include "fsdp/internal/check.h"

#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <typeinfo>

namespace fsdp::checkpoint::detail {
namespace {

using torch::optim::Adam;
using torch::optim::AdamOptions;
using torch::optim::AdamParamState;
using torch::optim::AdamW;
using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;
using torch::optim::SGD;
using torch::optim::SGDOptions;
using torch::optim::SGDParamState;

void* key_of(const at::Tensor& param) {
  return param.unsafeGetTensorImpl();
}

// Adam and AdamW have the same options and state under different types.
template <typename Options>
std::map<std::string, double> adam_options(const Options& o) {
  return {{"lr", o.lr()},   {"beta1", std::get<0>(o.betas())},  {"beta2", std::get<1>(o.betas())},
          {"eps", o.eps()}, {"weight_decay", o.weight_decay()}, {"amsgrad", o.amsgrad() ? 1.0 : 0.0}};
}

template <typename Options>
void set_adam_options(Options& o, const std::map<std::string, double>& v) {
  o.lr(v.at("lr"));
  o.betas(std::make_tuple(v.at("beta1"), v.at("beta2")));
  o.eps(v.at("eps"));
  o.weight_decay(v.at("weight_decay"));
  o.amsgrad(v.at("amsgrad") != 0);
}

template <typename State>
ParamState adam_state(const State& s) {
  ParamState out;
  out.step = s.step();
  out.tensors = {{"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}};
  if (s.max_exp_avg_sq().defined()) out.tensors.emplace_back("max_exp_avg_sq", s.max_exp_avg_sq());
  return out;
}

template <typename State>
void set_adam_state(State& s, const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                    int64_t step) {
  s.step(step);
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == "exp_avg") s.exp_avg(tensors[i]);
    if (names[i] == "exp_avg_sq") s.exp_avg_sq(tensors[i]);
    if (names[i] == "max_exp_avg_sq") s.max_exp_avg_sq(tensors[i]);
  }
}

template <typename State>
void zero_adam_state(State& s) {
  for (const at::Tensor& t : {s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()}) {
    if (t.defined()) at::Tensor(t).zero_();
  }
}

}  // namespace

std::string optimizer_type(const torch::optim::Optimizer& opt, const std::string& where) {
  if (dynamic_cast<const AdamW*>(&opt) != nullptr) return "AdamW";
  if (dynamic_cast<const Adam*>(&opt) != nullptr) return "Adam";
  if (dynamic_cast<const SGD*>(&opt) != nullptr) return "SGD";
  FSDP_CHECK(false, where, ": optimizer type ", c10::demangle(typeid(opt).name()),
             " is not supported (torch::optim::SGD, Adam, AdamW and fsdp::optim::FusedAdamW are); save the model "
             "alone, and the optimizer with torch::save.");
}

std::vector<std::string> state_names(const std::string& type) {
  if (type == "SGD") return {"momentum_buffer"};
  return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
}

std::map<std::string, double> group_options(const torch::optim::OptimizerParamGroup& group, const std::string& type) {
  const auto& o = group.options();
  if (type == "AdamW") return adam_options(static_cast<const AdamWOptions&>(o));
  if (type == "Adam") return adam_options(static_cast<const AdamOptions&>(o));
  const auto& s = static_cast<const SGDOptions&>(o);
  return {{"lr", s.lr()},
          {"momentum", s.momentum()},
          {"dampening", s.dampening()},
          {"weight_decay", s.weight_decay()},
          {"nesterov", s.nesterov() ? 1.0 : 0.0}};
}

void set_group_options(torch::optim::OptimizerParamGroup& group, const std::string& type,
                       const std::map<std::string, double>& options, const std::string& where) {
  const auto want = group_options(group, type);
  for (const auto& kv : want) {
    FSDP_CHECK(options.count(kv.first) == 1, where, ": the saved ", type, " param group has no '", kv.first, "'.");
  }
  for (const auto& kv : options) {
    FSDP_CHECK(want.count(kv.first) == 1, where, ": the saved ", type, " param group has '", kv.first, "', which ",
               type, " does not have.");
  }
  auto& o = group.options();
  if (type == "AdamW") {
    set_adam_options(static_cast<AdamWOptions&>(o), options);
  } else if (type == "Adam") {
    set_adam_options(static_cast<AdamOptions&>(o), options);
  } else {
    auto& s = static_cast<SGDOptions&>(o);
    s.lr(options.at("lr"));
    s.momentum(options.at("momentum"));
    s.dampening(options.at("dampening"));
    s.weight_decay(options.at("weight_decay"));
    s.nesterov(options.at("nesterov") != 0);
  }
}

ParamState param_state(const torch::optim::Optimizer& opt, const std::string& type, const at::Tensor& param) {
  const auto it = opt.state().find(key_of(param));
  if (it == opt.state().end() || !it->second) return {};
  if (type == "AdamW") return adam_state(static_cast<const AdamWParamState&>(*it->second));
  if (type == "Adam") return adam_state(static_cast<const AdamParamState&>(*it->second));
  ParamState out;
  const auto& s = static_cast<const SGDParamState&>(*it->second);
  if (s.momentum_buffer().defined()) out.tensors = {{"momentum_buffer", s.momentum_buffer()}};
  return out;
}

std::vector<at::Tensor> state_destinations(const torch::optim::Optimizer& opt, const std::string& type,
                                           const at::Tensor& param, const std::vector<std::string>& names) {
  const ParamState existing = param_state(opt, type, param);
  std::vector<at::Tensor> out;
  for (const auto& name : names) {
    at::Tensor t;
    for (const auto& [n, have] : existing.tensors) {
      if (n == name && have.defined() && have.sizes() == param.sizes() && have.dtype() == param.dtype()) t = have;
    }
    out.push_back(t.defined() ? t : at::empty_like(param, at::MemoryFormat::Contiguous));
  }
  return out;
}

void install_state(torch::optim::Optimizer& opt, const std::string& type, const at::Tensor& param,
                   const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors, int64_t step) {
  auto& slot = opt.state()[key_of(param)];
  if (names.empty() && step < 0) {
    if (slot && type == "AdamW") zero_adam_state(static_cast<AdamWParamState&>(*slot));
    if (slot && type == "Adam") zero_adam_state(static_cast<AdamParamState&>(*slot));
    opt.state().erase(key_of(param));
    return;
  }
  if (type == "AdamW") {
    if (!slot) slot = std::make_unique<AdamWParamState>();
    set_adam_state(static_cast<AdamWParamState&>(*slot), names, tensors, step);
  } else if (type == "Adam") {
    if (!slot) slot = std::make_unique<AdamParamState>();
    set_adam_state(static_cast<AdamParamState&>(*slot), names, tensors, step);
  } else {
    if (!slot) slot = std::make_unique<SGDParamState>();
    auto& s = static_cast<SGDParamState&>(*slot);
    s.momentum_buffer(names.empty() ? at::Tensor() : tensors.at(0));
  }
}

}  // namespace fsdp::checkpoint::detail
