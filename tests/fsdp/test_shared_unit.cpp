// One unit over sibling modules (fsdp::ShardedUnit::share_unit_with, FSDP2's fully_shard([norm,
// output])) and torchtitan's wrapping of the example GPT (gpt::Wrap::kTorchtitan: the token
// embedding, each block, and the final norm with the head as units): parity with plain LibTorch
// for every strategy, the parameter names unchanged, the unit gathered once per forward and once
// per backward (collective counts from shapes), built in a ShardingScope too, a tied embedding and
// head as one unit (checkpointed too), activation checkpointing of the shared unit bit-exact
// against off, and the refusals. Each world size is one launch that runs every case.
#include "tests/parity.h"

#include "fsdp/sharding_scope.h"

#include <torch/torch.h>

namespace fsdp::testing {
namespace {

gpt::Config titan_config() {
  gpt::Config c{29, 8, 3, 2, 12, true};
  c.wrap = gpt::Wrap::kTorchtitan;
  return c;
}

// Units and names: the root keeps wpe; the norm and head are one unit, their names their own.
void check_units_and_names(Rank& r) {
  const gpt::Config cfg = titan_config();
  torch::manual_seed(0);
  auto plain = gpt::make_gpt<false>(cfg);
  torch::manual_seed(0);
  auto model = fsdp::fully_shard(gpt::make_gpt<true>(cfg), r.pg, test_options());
  std::vector<std::string> units;
  for (const auto& u : model.units()) units.push_back(u.name);
  std::vector<std::string> want = {"", "wte"};
  for (int i = 0; i < cfg.n_layer; ++i) want.push_back("h." + std::to_string(i));
  want.push_back("ln_f+lm_head");
  EXPECT_EQ(units, want);
  const auto shared = model.units().back();
  EXPECT_EQ(shared.params, (std::vector<std::string>{"ln_f.weight", "ln_f.bias", "lm_head.weight"}));
  EXPECT_EQ(model.units().front().params, (std::vector<std::string>{"wpe.weight"}));
  std::vector<std::string> names, plain_names;
  for (const auto& kv : model.named_parameters()) names.push_back(kv.key());
  for (const auto& kv : plain->named_parameters()) plain_names.push_back(kv.key());
  EXPECT_EQ(names, plain_names);
}

// Parity with plain LibTorch, and the collectives from shapes: with full sharding the shared unit
// is gathered once in forward (before ln_f, kept through lm_head) and once in backward, like
// every other unit but the root (gathered once, kept for its backward); each unit reduces once.
void check_parity_and_counts(Rank& r) {
  const gpt::Config cfg = titan_config();
  const int units = static_cast<int>(cfg.n_layer) + 2;  // wte, blocks, ln_f+lm_head
  for (auto strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kShardOptimizerState,
        ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
    SCOPED_TRACE(to_string(strategy));
    const int group = strategy == ShardingStrategy::kHybridShard ? (r.world_size % 2 == 0 ? 2 : 1) : 0;
    torch::manual_seed(0);
    auto ref = gpt::make_gpt<false>(cfg);
    torch::manual_seed(0);
    auto model = fsdp::fully_shard(gpt::make_gpt<true>(cfg), r.pg, test_options(strategy, group));
    train_and_compare(
        r, Opt::kSGD, 2, ref, model, [&](int step) { return gpt_batch(cfg, 700 + step); }, gpt_loss,
        [&](int) {
          if (strategy != ShardingStrategy::kFullShard) return;
          EXPECT_EQ(model.comm_stats().all_gathers, 1 + 2 * units);
          EXPECT_EQ(model.comm_stats().reduce_scatters, 1 + units);
        });
    expect_shards_match(r, model, *ref);
  }
}

// Built in a ShardingScope: the norm and head, sharded as each was built, are merged into one
// unit when the model's constructor joins them; the same units, names and training as above.
void check_built_in_scope(Rank& r) {
  const gpt::Config cfg = titan_config();
  torch::manual_seed(0);
  auto ref = gpt::make_gpt<false>(cfg);
  torch::manual_seed(0);
  ShardingScope scope(r.pg, test_options());
  auto model = fsdp::fully_shard(gpt::make_gpt<true>(cfg), scope);
  EXPECT_EQ(model.units().back().name, "ln_f+lm_head");
  EXPECT_EQ(model.units().back().params, (std::vector<std::string>{"ln_f.weight", "ln_f.bias", "lm_head.weight"}));
  const int units = static_cast<int>(cfg.n_layer) + 2;
  train_and_compare(
      r, Opt::kSGD, 2, ref, model, [&](int step) { return gpt_batch(cfg, 800 + step); }, gpt_loss,
      [&](int) { EXPECT_EQ(model.comm_stats().all_gathers, 1 + 2 * units); });
  expect_shards_match(r, model, *ref);
}

// Activation checkpointing of every unit, the shared one included (its recompute runs ln_f and
// lm_head again while the unit is gathered for its backward): bit-exact against off, the same
// collectives.
void check_checkpointed(Rank& r) {
  gpt::Config cfg = titan_config();
  cfg.dropout = 0.1;
  auto run = [&](int every) {
    torch::manual_seed(0);
    auto model =
        fsdp::fully_shard(gpt::make_gpt<true>(cfg), r.pg, test_options().activation_checkpointing_every(every));
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
    std::vector<at::Tensor> out;
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      model.reset_comm_stats();
      auto [x, y] = gpt_batch(cfg, 60 + step);
      torch::manual_seed(7 + r.rank);
      auto loss = gpt_loss(model(local_rows(x, r.rank, r.world_size)), local_rows(y, r.rank, r.world_size));
      loss.backward();
      out.push_back(loss.detach());
      out.push_back(torch::tensor(model.comm_stats().all_gathers));
      for (const auto& p : model.parameters()) out.push_back(p.grad().clone());
      opt.step();
    }
    return out;
  };
  const auto off = run(0), on = run(1);
  ASSERT_EQ(off.size(), on.size());
  for (size_t i = 0; i < off.size(); ++i) EXPECT_TRUE(torch::equal(off[i], on[i])) << "tensor " << i << " differs";
}

// A tied embedding and head: the head's weight is the embedding's; the two modules share a unit,
// the tied weight is sharded once and trained once, as in plain LibTorch.
struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(const at::Tensor& w) : weight(register_parameter("weight", w)) {}
  at::Tensor forward(const at::Tensor& x) { return torch::matmul(x, weight.t()); }
  at::Tensor weight;
};
template <bool kSharded>
struct TiedNetImpl : torch::nn::Module {
  template <typename Impl>
  using Holder = std::conditional_t<kSharded, fsdp::Sharded<Impl>, torch::nn::ModuleHolder<Impl>>;
  TiedNetImpl()
      : wte(register_module("wte", Holder<torch::nn::EmbeddingImpl>(13, 8))),
        mid(register_module("mid", Holder<torch::nn::LinearImpl>(8, 8))),
        head(register_module("head", Holder<TiedHeadImpl>(wte->weight))) {
    if constexpr (kSharded) head->share_unit_with(*wte);
  }
  at::Tensor forward(const at::Tensor& idx) { return head(torch::tanh(mid(wte(idx)))); }
  Holder<torch::nn::EmbeddingImpl> wte;
  Holder<torch::nn::LinearImpl> mid;
  Holder<TiedHeadImpl> head;
};

std::vector<at::Tensor> unique_params(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) {
    bool seen = false;
    for (const auto& q : out) seen = seen || q.is_same(p);
    if (!seen) out.push_back(p);
  }
  return out;
}

// `checkpoint`: the tied unit checkpointed; its weight then gets its gradient in two recomputes'
// backwards (one per module), and the unit must wait for both before it reduces and reshards (it
// failed with an index out of range, the embedding recomputed on its shard, before it did).
void check_tied(Rank& r, ShardingStrategy strategy, bool checkpoint) {
  SCOPED_TRACE(std::string("tied, ") + to_string(strategy) + (checkpoint ? ", checkpointed" : ""));
  torch::manual_seed(3);
  auto ref = std::make_shared<TiedNetImpl<false>>();
  torch::manual_seed(3);
  auto net = std::make_shared<TiedNetImpl<true>>();
  if (checkpoint) net->head->set_activation_checkpointing(true);
  auto model = fsdp::fully_shard(net, r.pg, test_options(strategy, 0));
  ASSERT_EQ(model.units().size(), 3u);
  EXPECT_EQ(model.units()[1].name, "wte+head");
  EXPECT_EQ(model.units()[1].params, (std::vector<std::string>{"wte.weight"}));  // the tied weight once
  torch::optim::SGD ref_opt(unique_params(*ref), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_EQ(model.parameters().size(), unique_params(*ref).size());
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(90 + step);
    auto idx = torch::randint(13, {4 * r.world_size, 5}, torch::kLong);
    auto target = torch::randint(13, {4 * r.world_size, 5}, torch::kLong);
    ref_opt.zero_grad();
    auto ref_loss = gpt_loss(ref->forward(idx), target);
    ref_loss.backward();
    ref_opt.step();
    opt.zero_grad();
    model.reset_comm_stats();
    auto loss = gpt_loss(model(local_rows(idx, r.rank, r.world_size)), local_rows(target, r.rank, r.world_size));
    loss.backward();
    // The tied unit: gathered before wte, kept until head has run, once more for its backward.
    if (strategy == ShardingStrategy::kFullShard) {
      EXPECT_EQ(model.comm_stats().all_gathers, 2 + 2);  // the root holds no parameter: no gather
      EXPECT_EQ(model.comm_stats().reduce_scatters, 2);
    }
    opt.step();
    auto global = loss.detach().clone();
    all_reduce_sum(r, global);
    EXPECT_TRUE(close(global / r.world_size, ref_loss.detach())) << "step " << step;
  }
  const auto full = model.full_state_dict();
  for (const auto& kv : ref->named_parameters()) {
    EXPECT_TRUE(close(full[kv.key()], kv.value().detach())) << kv.key();
  }
}

// What cannot be done is refused before anything is sharded, naming the modules.
template <typename Fn>
void expect_error(Fn&& fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing: " << part;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

struct PairImpl : torch::nn::Module {
  PairImpl()
      : a(register_module("a", fsdp::Sharded<torch::nn::LinearImpl>(4, 4))),
        b(register_module("b", fsdp::Sharded<torch::nn::LinearImpl>(4, 4))) {}
  at::Tensor forward(const at::Tensor& x) { return b(a(x)); }
  fsdp::Sharded<torch::nn::LinearImpl> a, b;
};
struct NestedImpl : torch::nn::Module {
  NestedImpl()
      : inner(register_module("inner", fsdp::Sharded<PairImpl>())),
        c(register_module("c", fsdp::Sharded<torch::nn::LinearImpl>(4, 4))) {}
  at::Tensor forward(const at::Tensor& x) { return c(inner(x)); }
  fsdp::Sharded<PairImpl> inner;
  fsdp::Sharded<torch::nn::LinearImpl> c;
};

void check_refusals(Rank& r) {
  auto net = std::make_shared<PairImpl>();
  expect_error([&] { net->a->share_unit_with(*net->a); }, "was given itself");
  net->b->share_unit_with(*net->a);
  expect_error([&] { net->a->share_unit_with(*net->b); }, "in both directions");
  // Joined to a module of another model.
  auto other = std::make_shared<PairImpl>();
  auto stray = std::make_shared<PairImpl>();
  stray->b->share_unit_with(*other->a);
  expect_error([&] { fsdp::fully_shard(stray, r.pg, test_options()); }, "not part of this model");
  // Different settings on the two modules.
  auto conflict = std::make_shared<PairImpl>();
  conflict->b->share_unit_with(*conflict->a);
  conflict->a->set_sharding_strategy(ShardingStrategy::kNoShard);
  conflict->b->set_sharding_strategy(ShardingStrategy::kShardGradOp);
  expect_error([&] { fsdp::fully_shard(conflict, r.pg, test_options()); }, "set different sharding strategies");
  // Not siblings: c at the root level, inner.a inside the unit `inner`.
  auto nested = std::make_shared<NestedImpl>();
  nested->c->share_unit_with(*nested->inner->a);
  expect_error([&] { fsdp::fully_shard(nested, r.pg, test_options()); }, "not siblings");
  // After wrapping, units are fixed.
  auto wrapped = std::make_shared<PairImpl>();
  auto model = fsdp::fully_shard(wrapped, r.pg, test_options());
  expect_error([&] { wrapped->b->share_unit_with(*wrapped->a); }, "wrapped already");
  // A weight tied across modules built in a ShardingScope would be sharded twice.
  expect_error(
      [&] {
        ShardingScope scope(r.pg, test_options());
        std::make_shared<TiedNetImpl<true>>();
      },
      "was sharded already, by");
  // Activation checkpointing set on a unit built in a scope, before fully_shard: taken.
  {
    ShardingScope scope(r.pg, test_options());
    auto built = std::make_shared<PairImpl>();
    built->b->set_activation_checkpointing(true);
    auto wrapped_built = fsdp::fully_shard(built, scope);
    // Once wrapped, the setting is fixed and the refusal says what fully_shard made of it.
    expect_error([&] { built->b->set_activation_checkpointing(false); }, "sharded already (checkpointed)");
    expect_error([&] { built->a->set_activation_checkpointing(true); }, "sharded already (not checkpointed)");
  }
  // A module registered twice.
  auto twice = std::make_shared<PairImpl>();
  twice->register_module("again", twice->a.ptr());
  expect_error([&] { fsdp::fully_shard(twice, r.pg, test_options()); }, "is registered twice");
  // In a scope, the setting of the module that joined counts too.
  {
    ShardingScope scope(r.pg, test_options());
    auto built = std::make_shared<PairImpl>();
    built->b->share_unit_with(*built->a);
    built->b->set_activation_checkpointing(true);
    auto wrapped_built = fsdp::fully_shard(built, scope);
    expect_error([&] { built->a->set_activation_checkpointing(false); }, "sharded already (checkpointed)");
  }
  // One setting on either module serves the unit.
  auto one = std::make_shared<PairImpl>();
  one->b->share_unit_with(*one->a);
  one->b->set_sharding_strategy(ShardingStrategy::kShardGradOp);
  auto m = fsdp::fully_shard(one, r.pg, test_options());
  ASSERT_EQ(m.units().size(), 2u);
  EXPECT_EQ(m.units()[1].name, "a+b");
  EXPECT_EQ(m.units()[1].strategy, ShardingStrategy::kShardGradOp);
}

// A module that does not run in a forward: the unit is finished at the end of the model's forward
// (resharded), not left gathered; a checkpointed forward thrown away does not hold back the next
// backward's reductions (its recompute will not come: the step's state peak is the same).
struct MaybeImpl : torch::nn::Module {
  MaybeImpl()
      : a(register_module("a", fsdp::Sharded<torch::nn::LinearImpl>(4, 4))),
        b(register_module("b", fsdp::Sharded<torch::nn::LinearImpl>(4, 4))) {}
  at::Tensor forward(const at::Tensor& x) { return skip_b ? a(x) : b(a(x)); }
  fsdp::Sharded<torch::nn::LinearImpl> a, b;
  bool skip_b = false;
};

void check_unrun_member_and_dropped_forward(Rank& r) {
  auto net = std::make_shared<MaybeImpl>();
  net->b->share_unit_with(*net->a);
  auto model = fsdp::fully_shard(net, r.pg, test_options());
  net->skip_b = true;
  {
    torch::NoGradGuard no_grad;
    model(torch::randn({2, 4}));
  }
  for (const auto& u : model.units()) EXPECT_FALSE(u.unsharded) << "unit '" << u.name << "' left gathered";
  model(torch::randn({2, 4})).sum().backward();  // with gradients, b not run: a's gradient only
  for (const auto& u : model.units()) EXPECT_FALSE(u.unsharded) << "unit '" << u.name << "' after backward";
  net->skip_b = false;

  gpt::Config cfg = titan_config();
  torch::manual_seed(0);
  auto gpt_model = fsdp::fully_shard(gpt::make_gpt<true>(cfg), r.pg, test_options().activation_checkpointing_every(1));
  auto [x, y] = gpt_batch(cfg, 31);
  auto mine_x = local_rows(x, r.rank, r.world_size), mine_y = local_rows(y, r.rank, r.world_size);
  auto step_peak = [&] {
    gpt_model.track_state_peak(true);
    gpt_loss(gpt_model(mine_x), mine_y).backward();
    gpt_model.track_state_peak(false);
    return gpt_model.state_peak_bytes();
  };
  step_peak();  // the first step allocates the sharded gradients the later ones add to
  const int64_t plain = step_peak();
  gpt_model(mine_x);  // thrown away: its checkpoints' graphs are freed without a backward
  EXPECT_EQ(step_peak(), plain) << "a dropped checkpointed forward held the next backward's reductions back";
}

void run_all(Rank& r) {
  check_units_and_names(r);
  check_parity_and_counts(r);
  check_built_in_scope(r);
  check_checkpointed(r);
  check_tied(r, ShardingStrategy::kFullShard, false);
  check_tied(r, ShardingStrategy::kFullShard, true);
  check_tied(r, ShardingStrategy::kNoShard, true);  // buckets wait for both recomputes too
  check_refusals(r);
  check_unrun_member_and_dropped_forward(r);
}

}  // namespace

class SharedUnit : public ::testing::TestWithParam<int> {};
TEST_P(SharedUnit, TorchtitanWrappingAndTiedUnitsKeepParityWithOneGatherPerPass) {
  RunOptions o;
  o.timeout = std::chrono::seconds(240);
  run_ranks(GetParam(), run_all, o);
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, SharedUnit, ::testing::Values(1, 3));

}  // namespace fsdp::testing
