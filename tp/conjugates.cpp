#include "tp/conjugates.h"

#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"

#include <ATen/ops/empty.h>
#include <torch/autograd.h>

#include <sstream>

namespace fsdp::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Carries the group into backward (a Function's saved data holds IValues).
struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(Group g) : group(std::move(g)) {}
  Group group;
};

void save_group(AutogradContext* ctx, const Group& group, int64_t dim = 0) {
  ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(group));
  ctx->saved_data["dim"] = dim;
}
const Group& saved_group(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<GroupCapsule>(ctx->saved_data["group"].toCapsule())->group;
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

// "tensor parallel f backward: all-reduce of a [4, 8, 64] Float gradient": what the collective
// is, in the call log and in errors (which add the rank, the mesh coordinates and the group).
std::string describe(const char* role, const char* op, const at::Tensor& t, const char* of) {
  return std::string("tensor parallel ") + role + ": " + op + " of a " + shape_of(t) + " " +
         c10::toString(t.scalar_type()) + " " + of;
}

at::Tensor all_reduce(const at::Tensor& x, const Group& g, const std::string& what) {
  at::Tensor t = x.clone(at::MemoryFormat::Contiguous);
  detail::tp_comm(g).all_reduce(t, c10d::ReduceOp::SUM, what);
  return t;
}

int64_t checked_dim(const at::Tensor& x, int64_t dim, const Group& g, const char* fn) {
  FSDP_CHECK(x.dim() > 0, "fsdp::tp::", fn, " on ", g.where(),
             ": the tensor is a scalar; it needs a dimension to split");
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  FSDP_CHECK(d >= 0 && d < x.dim(), "fsdp::tp::", fn, " on ", g.where(), ": dimension ", dim,
             " is out of range for a tensor of shape ", shape_of(x));
  return d;
}

// All-gather along `d`: rank r's [.., n, ..] at [.., r n : (r + 1) n, ..].
at::Tensor gather_along(const at::Tensor& x, int64_t d, const Group& g, const std::string& what) {
  const int T = g.size();
  at::Tensor in = x.contiguous();
  std::vector<int64_t> stacked{T};
  stacked.insert(stacked.end(), in.sizes().begin(), in.sizes().end());
  at::Tensor out = at::empty(stacked, in.options());
  at::Tensor flat_in = in.view({-1}), flat_out = out.view({-1});  // flat, as the backends take them
  detail::tp_comm(g).all_gather(flat_out, flat_in, what);
  std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
  shape[d] *= T;
  return d == 0 ? out.view(shape) : out.movedim(0, d).reshape(shape);
}

// Reduce-scatter along `d`: the sum over ranks of [.., r n : (r + 1) n, ..] on rank r.
at::Tensor reduce_scatter_along(const at::Tensor& x, int64_t d, const Group& g, const char* fn,
                                const std::string& what) {
  const int T = g.size();
  FSDP_CHECK(x.size(d) % T == 0, "fsdp::tp::", fn, " on ", g.where(), ": dimension ", d, " of a tensor of shape ",
             shape_of(x), " has ", x.size(d), " elements, which the ", T,
             " tensor-parallel ranks cannot split evenly; choose a sequence length (or batch) divisible by ", T, ".");
  std::vector<int64_t> split(x.sizes().begin(), x.sizes().end());
  split[d] /= T;
  std::vector<int64_t> parts(x.sizes().begin(), x.sizes().begin() + d);
  parts.push_back(T);
  parts.insert(parts.end(), split.begin() + d, split.end());
  at::Tensor in = x.reshape(parts).movedim(d, 0).contiguous();
  at::Tensor out = at::empty(split, x.options());
  // Flat, as the backends take them (Gloo checks dimension 0: T times the output's).
  at::Tensor flat_in = in.view({-1}), flat_out = out.view({-1});
  detail::Pending p = detail::tp_comm(g).reduce_scatter_sum_async(flat_out, flat_in, what);
  detail::tp_comm(g).wait(p);
  return out;
}

at::Tensor own_part(const at::Tensor& x, int64_t d, const Group& g, const char* fn) {
  const int T = g.size();
  FSDP_CHECK(x.size(d) % T == 0, "fsdp::tp::", fn, " on ", g.where(), ": dimension ", d, " of a tensor of shape ",
             shape_of(x), " has ", x.size(d), " elements, which the ", T,
             " tensor-parallel ranks cannot split evenly; choose sizes divisible by ", T, ".");
  const int64_t n = x.size(d) / T;
  return x.narrow(d, g.rank() * n, n).contiguous();
}

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Group& g) {
    save_group(ctx, g);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Group& g = saved_group(ctx);
    return {all_reduce(grads[0], g, describe("f backward", "all-reduce", grads[0], "gradient")), at::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext* /*ctx*/, const at::Tensor& x, const Group& g) {
    return all_reduce(x, g, describe("g forward", "all-reduce", x, "activation"));
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) { return {grads[0], at::Tensor()}; }
};

struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Group& g, int64_t d, bool sequence) {
    save_group(ctx, g, d);
    ctx->saved_data["sequence"] = sequence;
    return gather_along(
        x, d, g, describe(sequence ? "sequence gather forward" : "gather forward", "all-gather", x, "activation"));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Group& g = saved_group(ctx);
    const int64_t d = ctx->saved_data["dim"].toInt();
    if (ctx->saved_data["sequence"].toBool()) {  // the ranks' gradients of the gathered sequence: summed
      return {reduce_scatter_along(grads[0], d, g, "gather_from_sequence_region",
                                   describe("sequence gather backward", "reduce-scatter", grads[0], "gradient")),
              at::Tensor(), at::Tensor(), at::Tensor()};
    }
    return {own_part(grads[0], d, g, "gather_from_region"), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct ScatterToRegion : torch::autograd::Function<ScatterToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Group& g, int64_t d, bool sequence) {
    save_group(ctx, g, d);
    ctx->saved_data["sequence"] = sequence;
    return own_part(x, d, g, sequence ? "scatter_to_sequence_region" : "scatter_to_region");
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Group& g = saved_group(ctx);
    const int64_t d = ctx->saved_data["dim"].toInt();
    const bool sequence = ctx->saved_data["sequence"].toBool();
    return {gather_along(grads[0], d, g,
                         describe(sequence ? "sequence scatter backward" : "scatter backward", "all-gather", grads[0],
                                  "gradient")),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterToSequence : torch::autograd::Function<ReduceScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Group& g, int64_t d) {
    save_group(ctx, g, d);
    return reduce_scatter_along(x, d, g, "reduce_scatter_to_sequence_region",
                                describe("sequence reduce-scatter forward", "reduce-scatter", x, "activation"));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Group& g = saved_group(ctx);
    const int64_t d = ctx->saved_data["dim"].toInt();
    return {
        gather_along(grads[0], d, g, describe("sequence reduce-scatter backward", "all-gather", grads[0], "gradient")),
        at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor copy_to_region(const at::Tensor& x, const Group& group) {
  return CopyToRegion::apply(x, group);
}

at::Tensor reduce_from_region(const at::Tensor& x, const Group& group) {
  return ReduceFromRegion::apply(x, group);
}

at::Tensor gather_from_region(const at::Tensor& x, const Group& group) {
  return GatherFromRegion::apply(x, group, checked_dim(x, -1, group, "gather_from_region"), false);
}

at::Tensor scatter_to_region(const at::Tensor& x, const Group& group) {
  return ScatterToRegion::apply(x, group, checked_dim(x, -1, group, "scatter_to_region"), false);
}

at::Tensor gather_from_sequence_region(const at::Tensor& x, const Group& group, int64_t dim) {
  return GatherFromRegion::apply(x, group, checked_dim(x, dim, group, "gather_from_sequence_region"), true);
}

at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& x, const Group& group, int64_t dim) {
  return ReduceScatterToSequence::apply(x, group, checked_dim(x, dim, group, "reduce_scatter_to_sequence_region"));
}

at::Tensor scatter_to_sequence_region(const at::Tensor& x, const Group& group, int64_t dim) {
  return ScatterToRegion::apply(x, group, checked_dim(x, dim, group, "scatter_to_sequence_region"), true);
}

}  // namespace fsdp::tp
