// LocalSGD and DiLoCo over hybrid sharding's replicas (4 ranks: 2 replicas x 2 shards), in one
// launch: LocalSGD at H = 1 with plain SGD equals hybrid sharding; at H = 4 with AdamW and
// clipping it equals a one-process reference that runs the two replicas in turn on their rows and
// averages (every step, each replica's own weights); DiLoCo with outer SGD at lr 1 and momentum 0
// equals LocalSGD while its default outer optimizer does not; streaming fragments average in turn;
// a replica may run forwards the other does not (nothing crosses replicas between outer steps);
// the bytes across replicas of every step from shapes; settings refused by name.
#include "fsdp/fsdp.h"
#include "tests/harness.h"
#include "tests/models.h"

#include "checkpoint/async_save.h"
#include "tests/checkpoint_helpers.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace fsdp::testing {
namespace {

constexpr int kWorld = 4, kS = 2, kReplicas = kWorld / kS;
using MLP = UnevenMLPImpl<true>;  // units: the root (head, scale), fc1, fc2
using Plain = std::shared_ptr<UnevenMLPImpl<false>>;

// Step `s`'s global batch: replica r's rows are [6r, 6r + 6), rank k's [3k, 3k + 3).
std::pair<torch::Tensor, torch::Tensor> batch(int s) {
  torch::manual_seed(1000 + s);
  return {torch::randn({kGlobalBatch, 7}), torch::randn({kGlobalBatch, 3})};
}

FullyShardedModule<MLP> hybrid(const Rank& r) {
  torch::manual_seed(1);
  return fully_shard(std::make_shared<MLP>(), r.pg, test_options(ShardingStrategy::kHybridShard, kS));
}

Plain plain_model() {
  torch::manual_seed(1);
  return std::make_shared<UnevenMLPImpl<false>>();
}

// One step of the wrapped model on this rank's rows; returns the loss.
double train_step(FullyShardedModule<MLP>& model, const Rank& r, int s) {
  const auto [x, y] = batch(s);
  auto loss = torch::mse_loss(model(local_rows(x, r.rank, kWorld)), local_rows(y, r.rank, kWorld));
  loss.backward();
  return loss.item<double>();
}

// The replica's whole weights (gathered over its shard group), by name.
torch::OrderedDict<std::string, torch::Tensor> weights(const FSDPModule& model) {
  return model.full_state_dict();
}

void expect_close(const FSDPModule& model, torch::nn::Module& ref, double rtol, const std::string& label) {
  const auto mine = weights(model);
  for (const auto& kv : ref.named_parameters())
    EXPECT_TRUE(close(mine[kv.key()], kv.value(), rtol)) << label << ": " << kv.key();
}

double max_difference(const FSDPModule& a, const FSDPModule& b) {
  const auto wa = weights(a), wb = weights(b);
  double d = 0;
  for (const auto& kv : wa) d = std::max(d, (kv.value() - wb[kv.key()]).abs().max().item<double>());
  return d;
}

// Bytes from shapes: twice the fp32 bytes of an all-reduce of `numel` elements.
int64_t all_reduce_bytes(int64_t numel) {
  return 2 * 4 * numel;
}

// Elements of this rank's rows of every parameter (`padded`: each parameter's c rows, as a unit's
// flat shard holds them), of the parameters `in` accepts (all without it).
int64_t shard_elements(const Rank& r, torch::nn::Module& ref, bool padded,
                       const std::function<bool(const std::string&)>& in = {}) {
  int64_t n = 0;
  for (const auto& kv : ref.named_parameters()) {
    if (in && !in(kv.key())) continue;
    const RowLayout l = row_layout(kv.value().sizes(), kS);
    n += (padded ? l.chunk_rows() : l.local_rows(r.rank % kS)) * l.row_numel;
  }
  return n;
}

// LocalSGD at H = 1 with plain SGD is hybrid sharding: the mean of the replicas' SGD steps is the
// step on the mean gradient. Hybrid's bytes across replicas per step: its gradients' all-reduce.
void local_sgd_h1_is_hybrid(const Rank& r) {
  auto a = hybrid(r);
  auto b = hybrid(r);
  torch::optim::SGD sa(a.parameters(), 0.1), sb(b.parameters(), 0.1);
  optim::LocalSGD local(b, sb, optim::LocalSGDOptions(1));
  Plain ref = plain_model();
  const int64_t padded = shard_elements(r, *ref, /*padded=*/true);
  for (int s = 0; s < 4; ++s) {
    a.reset_comm_stats();
    train_step(a, r, s);
    EXPECT_EQ(a.comm_stats().replica_bytes, all_reduce_bytes(padded)) << "hybrid, step " << s;
    sa.step();
    sa.zero_grad();
    train_step(b, r, s);
    local.step();
    sb.zero_grad();
    EXPECT_LE(max_difference(a, b), 1e-6 * weights(a)["fc1.weight"].abs().max().item<double>()) << "step " << s;
  }
}

// The reference: the two replicas trained one after another in this process, each on its rows,
// with its own AdamW and clipping; every H steps (fragment by fragment: `fragment_of` a name) the
// parameters of the fragments due are replaced by the replicas' mean. Overlapped: the mean of the
// parameters as they are at the due step is applied after the next inner step, as p += mean - p_then.
struct Reference {
  Plain replica[kReplicas] = {plain_model(), plain_model()};
  std::vector<std::unique_ptr<torch::optim::AdamW>> opt;
  bool overlap = false;
  std::map<std::string, std::vector<torch::Tensor>> in_flight;  // name: mean, then each replica's p_then
  explicit Reference(bool overlap) : overlap(overlap) {
    for (auto& m : replica) opt.push_back(std::make_unique<torch::optim::AdamW>(m->parameters(), 1e-2));
  }
  void flush() {
    torch::NoGradGuard no_grad;
    for (const auto& [name, t] : in_flight) {
      for (int k = 0; k < kReplicas; ++k) replica[k]->named_parameters()[name].add_(t[0] - t[1 + k]);
    }
    in_flight.clear();
  }
  void step(int s, const std::vector<bool>& due, const std::function<int(const std::string&)>& fragment_of) {
    const auto [x, y] = batch(s);
    for (int k = 0; k < kReplicas; ++k) {
      auto loss = torch::mse_loss(replica[k]->forward(x.narrow(0, 6 * k, 6)), y.narrow(0, 6 * k, 6));
      loss.backward();
      torch::nn::utils::clip_grad_norm_(replica[k]->parameters(), 0.05);
      opt[k]->step();
      opt[k]->zero_grad();
    }
    flush();
    torch::NoGradGuard no_grad;
    auto p0 = replica[0]->named_parameters(), p1 = replica[1]->named_parameters();
    for (const auto& kv : p0) {
      if (!due[fragment_of(kv.key())]) continue;
      const torch::Tensor mean = (kv.value() + p1[kv.key()]) / 2;
      if (overlap) {
        in_flight[kv.key()] = {mean, kv.value().clone(), p1[kv.key()].clone()};
      } else {
        kv.value().copy_(mean);
        p1[kv.key()].copy_(mean);
      }
    }
  }
};

// H = 4 with AdamW and clipping (each replica's norm), against the reference; one fragment or two
// (the root and fc1, then fc2: averaged after steps 2 and 4 of each period). Replica 0 also runs
// no-grad forwards that replica 1 does not: no agreement of a step spans both replicas.
void local_sgd_h4_matches_reference(const Rank& r, int fragments, bool overlap = false) {
  const std::string label =
      "LocalSGD H 4, " + std::to_string(fragments) + " fragment(s)" + (overlap ? ", overlapped" : "");
  auto model = hybrid(r);
  torch::optim::AdamW inner(model.parameters(), 1e-2);
  Plain shapes = plain_model();
  // What crosses replicas is the units' flat shards: each parameter's c rows, padding included.
  const int64_t padded = shard_elements(r, *shapes, true);
  model.reset_comm_stats();
  optim::LocalSGD sgd(model, inner, optim::LocalSGDOptions(4).fragments(fragments).overlap(overlap));
  EXPECT_EQ(model.comm_stats().replica_bytes, 4 * padded) << label << ": the first replica's shards, broadcast";
  EXPECT_EQ(sgd.replicas(), kReplicas);
  EXPECT_EQ(sgd.replica(), r.rank / kS);
  auto fragment_of = [&](const std::string& name) { return fragments == 2 && name.rfind("fc2", 0) == 0 ? 1 : 0; };
  Reference ref(overlap);
  for (int s = 0; s < 12; ++s) {
    model.reset_comm_stats();
    train_step(model, r, s);
    optim::clip_grad_norm(model, 0.05);
    sgd.step();
    inner.zero_grad();
    const int t = (s + 1) % 4;
    std::vector<bool> due{fragments == 1 ? t == 0 : t == 2, fragments == 2 && t == 0};
    int64_t want = 0;
    for (int f = 0; f < fragments; ++f) {
      if (due[f]) {
        want += all_reduce_bytes(
            shard_elements(r, *shapes, true, [&](const std::string& n) { return fragment_of(n) == f; }));
      }
    }
    EXPECT_EQ(model.comm_stats().replica_bytes, want) << label << ", step " << s;
    ref.step(s, due, fragment_of);
    expect_close(model, *ref.replica[r.rank / kS], 1e-6, label + ", step " + std::to_string(s));
    if (r.rank / kS == 0 && s % 3 == 1) {  // a validation forward in replica 0 only
      torch::NoGradGuard no_grad;
      model(torch::randn({3, 7}));
    }
  }
  EXPECT_EQ(sgd.inner_steps(), 12);
  // Overlapped, the last average (after step 12) is still in flight: flush() applies it.
  sgd.flush();
  ref.flush();
  expect_close(model, *ref.replica[r.rank / kS], 1e-6, label + ", flushed");
}

// DiLoCo with outer SGD at lr 1, momentum 0 equals LocalSGD (the global shards become the mean);
// at its default outer optimizer (Nesterov, 0.7, 0.9) it does not.
void diloco_against_local_sgd(const Rank& r) {
  auto a = hybrid(r), b = hybrid(r), c = hybrid(r);
  torch::optim::AdamW ia(a.parameters(), 1e-2), ib(b.parameters(), 1e-2), ic(c.parameters(), 1e-2);
  optim::LocalSGD local(a, ia, optim::LocalSGDOptions(4));
  optim::DiLoCo plain_outer(b, ib, optim::DiLoCoOptions(4).outer_lr(1).outer_momentum(0));
  optim::DiLoCo nesterov(c, ic, optim::DiLoCoOptions(4));
  // The same two, overlapped.
  auto d = hybrid(r), e = hybrid(r);
  torch::optim::AdamW id(d.parameters(), 1e-2), ie(e.parameters(), 1e-2);
  optim::LocalSGD local_overlapped(d, id, optim::LocalSGDOptions(4).overlap(true));
  optim::DiLoCo outer_overlapped(e, ie, optim::DiLoCoOptions(4).outer_lr(1).outer_momentum(0).overlap(true));
  for (int s = 0; s < 8; ++s) {
    for (auto* m : {&a, &b, &c, &d, &e}) train_step(*m, r, s);
    local.step();
    plain_outer.step();
    nesterov.step();
    local_overlapped.step();
    outer_overlapped.step();
    for (auto* o : {&ia, &ib, &ic, &id, &ie}) o->zero_grad();
    const double scale = weights(a)["fc1.weight"].abs().max().item<double>();
    EXPECT_LE(max_difference(a, b), 1e-6 * scale) << "DiLoCo (lr 1, momentum 0) vs LocalSGD, step " << s;
    EXPECT_LE(max_difference(d, e), 1e-6 * scale) << "the same, overlapped, step " << s;
    if (s == 4) EXPECT_GT(max_difference(a, d), 1e-4 * scale) << "overlapped applies its average a step later";
    if (s == 3 || s == 7) {
      EXPECT_GT(max_difference(a, c), 1e-3 * scale) << "DiLoCo's default outer step must move differently, step " << s;
    }
  }
  // The outer state: fp32 global shards (flat per unit, padded as the flat shards are) and the
  // momentum (one per parameter: its rows).
  Plain shapes = plain_model();
  const auto bytes = optim::state_bytes(nesterov.global_shards(), &nesterov.outer_optimizer());
  EXPECT_EQ(bytes.params, 4 * shard_elements(r, *shapes, true));
  EXPECT_EQ(bytes.optimizer, 4 * shard_elements(r, *shapes, false));
}

void refusals(const Rank& r) {
  torch::manual_seed(1);
  auto full = fully_shard(std::make_shared<MLP>(), r.pg, test_options());
  torch::optim::SGD opt(full.parameters(), 0.1);
  const std::string no_replicas = error_of([&] { optim::LocalSGD(full, opt, optim::LocalSGDOptions(4)); });
  EXPECT_NE(no_replicas.find("not hybrid-sharded"), std::string::npos) << no_replicas;
  EXPECT_NE(no_replicas.find("kHybridShard"), std::string::npos) << no_replicas;
  auto model = hybrid(r);
  torch::optim::SGD opt2(model.parameters(), 0.1);
  const std::string fragments = error_of([&] { optim::DiLoCo(model, opt2, optim::DiLoCoOptions(4).fragments(3)); });
  EXPECT_NE(fragments.find("3 fragment(s) do not divide sync_every = 4"), std::string::npos) << fragments;
  const std::string too_many = error_of([&] { optim::LocalSGD(model, opt2, optim::LocalSGDOptions(8).fragments(4)); });
  EXPECT_NE(too_many.find("the model has 3 unit(s) holding parameters"), std::string::npos) << too_many;
  const std::string lr = error_of([&] { optim::DiLoCo(model, opt2, optim::DiLoCoOptions(4).outer_lr(0)); });
  EXPECT_NE(lr.find("outer_lr is 0"), std::string::npos) << lr;
  EXPECT_EQ(lr.rfind("fsdp::optim::DiLoCo (rank " + std::to_string(r.rank) + " of 4): outer_lr is 0", 0), 0u) << lr;
  {
    // One outer optimizer per model: a second would keep its own schedule and state.
    optim::LocalSGD first(model, opt2, optim::LocalSGDOptions(4));
    const std::string twice = error_of([&] { optim::DiLoCo(model, opt2, optim::DiLoCoOptions(4)); });
    EXPECT_NE(twice.find("already driven by a LocalSGD"), std::string::npos) << twice;
  }
  // Once it is gone, the replicas still train apart: a checkpoint (which needs the outer state)
  // is refused before anything happens, and the next forward warns that nothing averages them.
  const std::string gone = error_of([&] { checkpoint::save(shared_dir() + "/gone", model, opt2); });
  EXPECT_NE(gone.find("is gone"), std::string::npos) << gone;
  WarningCapture capture;
  torch::NoGradGuard no_grad;
  model(torch::randn({3, 7}));
  model(torch::randn({3, 7}));
  EXPECT_EQ(capture.text().find("drift apart for good"), capture.text().rfind("drift apart for good"))
      << capture.text();
  EXPECT_NE(capture.text().find("drift apart for good"), std::string::npos) << capture.text();
  // Settings that differ between ranks: every rank names rank 0's and the first other rank's.
  auto mixed = hybrid(r);
  torch::optim::SGD opt3(mixed.parameters(), 0.1);
  const std::string differ =
      error_of([&] { optim::LocalSGD(mixed, opt3, optim::LocalSGDOptions(r.rank == 2 ? 8 : 4)); });
  EXPECT_NE(differ.find("rank 0 has sync_every 4, fragments 1"), std::string::npos) << differ;
  EXPECT_NE(differ.find("rank 2 has sync_every 8, fragments 1"), std::string::npos) << differ;
}

// Every element of `a` equals `b`'s (the same replica's weights, or its global state).
void expect_same(const torch::OrderedDict<std::string, torch::Tensor>& a,
                 const torch::OrderedDict<std::string, torch::Tensor>& b, const std::string& label) {
  ASSERT_EQ(a.size(), b.size()) << label;
  for (const auto& kv : a) EXPECT_TRUE(torch::equal(kv.value(), b[kv.key()])) << label << ": " << kv.key();
}

// Bytes of the checkpoint's tensors whose key starts with `prefix`, from the manifest's shapes.
int64_t saved_bytes(const std::string& dir, const std::string& prefix) {
  int64_t n = 0;
  for (const auto& t : checkpoint::read_manifest(checkpoint::latest_checkpoint(dir)).tensors) {
    if (t.key.rfind(prefix, 0) == 0) n += static_cast<int64_t>(t.bytes());
  }
  return n;
}

// 4 ranks, 2 replicas x 2: DiLoCo (Nesterov) saved after 6 steps, mid-period, and loaded into a new
// model on the same replicas: each replica's own weights and the global shards bit-exact (a save
// that mixed the replicas' rows would fail here: they differ), and 4 more steps (an outer step
// among them, the outer momentum restored) equal the uninterrupted run's. LocalSGD saved with an
// AsyncSaver, the same. The checkpoint's bytes from shapes: per replica its weights and AdamW's
// two moments (12Ψ), the global state and the outer momentum once (4Ψ each).
void save_and_resume_on_the_same_replicas(const Rank& r) {
  const std::string dir = root_dir();
  auto a = hybrid(r), b = hybrid(r);
  torch::optim::AdamW ia(a.parameters(), 1e-2), ib(b.parameters(), 1e-2);
  optim::DiLoCo da(a, ia, optim::DiLoCoOptions(4)), db(b, ib, optim::DiLoCoOptions(4));
  for (int s = 0; s < 6; ++s) {
    for (auto* m : {&a, &b}) train_step(*m, r, s);
    da.step();
    db.step();
    ia.zero_grad();
    ib.zero_grad();
  }
  checkpoint::save(dir + "/diloco", b, ib, checkpoint::SaveOptions().step(6));
  auto c = hybrid(r);
  torch::optim::AdamW ic(c.parameters(), 1e-2);
  optim::DiLoCo dc(c, ic, optim::DiLoCoOptions(4));
  const auto res = checkpoint::load(dir + "/diloco", c, ic);
  EXPECT_EQ(res.replicas, "each of the 2 replicas its own state, at inner step 6");
  EXPECT_EQ(dc.inner_steps(), 6);
  expect_same(weights(c), weights(b), "DiLoCo, loaded");
  for (size_t i = 0; i < db.global_shards().size(); ++i) {
    EXPECT_TRUE(torch::equal(dc.global_shards()[i], db.global_shards()[i])) << "global shard " << i;
  }
  for (int s = 6; s < 10; ++s) {
    for (auto* m : {&a, &c}) train_step(*m, r, s);
    da.step();
    dc.step();
    ia.zero_grad();
    ic.zero_grad();
    EXPECT_LE(max_difference(a, c), 1e-5 * weights(a)["fc1.weight"].abs().max().item<double>()) << "step " << s;
  }
  Plain shapes = plain_model();
  int64_t psi = 0;
  for (const auto& p : shapes->parameters()) psi += p.numel();
  for (int k = 0; k < kReplicas; ++k) {
    const std::string rk = "replica" + std::to_string(k) + "/";
    EXPECT_EQ(saved_bytes(dir + "/diloco", rk + "model/"), 4 * psi);
    EXPECT_EQ(saved_bytes(dir + "/diloco", rk + "optim/"), 8 * psi);
  }
  EXPECT_EQ(saved_bytes(dir + "/diloco", "model/"), 4 * psi);
  EXPECT_EQ(saved_bytes(dir + "/diloco", "outer/"), 4 * psi);

  // LocalSGD, saved in the background, at the reference's step 6.
  auto d = hybrid(r);
  torch::optim::AdamW id(d.parameters(), 1e-2);
  optim::LocalSGD ld(d, id, optim::LocalSGDOptions(4));
  for (int s = 0; s < 6; ++s) {
    train_step(d, r, s);
    optim::clip_grad_norm(d, 0.05);
    ld.step();
    id.zero_grad();
  }
  {
    checkpoint::AsyncSaver saver(d);
    saver.save(dir + "/local", id, checkpoint::SaveOptions().step(6));
    saver.wait();
  }
  auto e = hybrid(r);
  torch::optim::AdamW ie(e.parameters(), 1e-2);
  optim::LocalSGD le(e, ie, optim::LocalSGDOptions(4));
  checkpoint::load(dir + "/local", e, ie);
  expect_same(weights(e), weights(d), "LocalSGD, loaded");
}

// 2 ranks: the LocalSGD checkpoint of 2 replicas x 2 shards on 2 replicas x 1 shard (each replica
// its own state, then training as the reference to step 12), and the DiLoCo one on 1 replica of 2
// shards: every rank starts from the global state ("model/", what a plain load reads), at the last
// outer step's inner count, and trains.
void resume_on_other_ranks(const Rank& r) {
  const std::string dir = root_dir();
  torch::manual_seed(1);
  auto one_shard = fully_shard(std::make_shared<MLP>(), r.pg, test_options(ShardingStrategy::kHybridShard, 1));
  torch::optim::AdamW inner(one_shard.parameters(), 1e-2);
  optim::LocalSGD local(one_shard, inner, optim::LocalSGDOptions(4));
  const auto res = checkpoint::load(dir + "/local", one_shard, inner);
  EXPECT_EQ(res.replicas, "each of the 2 replicas its own state, at inner step 6");
  Reference ref(false);
  auto fragment_of = [](const std::string&) { return 0; };
  for (int s = 0; s < 6; ++s) ref.step(s, {(s + 1) % 4 == 0}, fragment_of);
  expect_close(one_shard, *ref.replica[r.rank], 1e-6, "loaded on 2 replicas of 1 rank");
  for (int s = 6; s < 12; ++s) {
    const auto [x, y] = batch(s);
    auto loss = torch::mse_loss(one_shard(x.narrow(0, 6 * r.rank, 6)), y.narrow(0, 6 * r.rank, 6));
    loss.backward();
    optim::clip_grad_norm(one_shard, 0.05);
    local.step();
    inner.zero_grad();
    ref.step(s, {(s + 1) % 4 == 0}, fragment_of);
    expect_close(one_shard, *ref.replica[r.rank], 1e-6, "resumed on 2 replicas of 1 rank, step " + std::to_string(s));
  }

  // Saved again, synchronously (LocalSGD's global state, the replicas' mean, is taken inside the
  // save's first phase), and loaded back: each replica its own weights.
  checkpoint::save(dir + "/local-sync", one_shard, inner, checkpoint::SaveOptions().step(12));
  torch::manual_seed(1);
  auto back = fully_shard(std::make_shared<MLP>(), r.pg, test_options(ShardingStrategy::kHybridShard, 1));
  torch::optim::AdamW inner_back(back.parameters(), 1e-2);
  optim::LocalSGD local_back(back, inner_back, optim::LocalSGDOptions(4));
  checkpoint::load(dir + "/local-sync", back, inner_back);
  expect_same(weights(back), weights(one_shard), "LocalSGD saved synchronously, loaded");
  EXPECT_EQ(local_back.inner_steps(), 12);

  torch::manual_seed(1);
  auto one_replica = fully_shard(std::make_shared<MLP>(), r.pg, test_options(ShardingStrategy::kHybridShard, 2));
  torch::optim::AdamW inner2(one_replica.parameters(), 1e-2);
  optim::DiLoCo diloco(one_replica, inner2, optim::DiLoCoOptions(4));
  const auto res2 = checkpoint::load(dir + "/diloco", one_replica, inner2);
  EXPECT_EQ(res2.replicas,
            "restarted from the global state at inner step 4 (saved by 2 replicas training apart, loaded on 1)");
  EXPECT_EQ(diloco.inner_steps(), 4);
  torch::manual_seed(1);
  auto plain = fully_shard(std::make_shared<MLP>(), r.pg, test_options());
  torch::optim::AdamW inner3(plain.parameters(), 1e-2);
  // The global state, replica 0's AdamW state; said, since a DiLoCo made after it finds nothing.
  EXPECT_EQ(checkpoint::load(dir + "/diloco", plain, inner3).replicas,
            "the global state (saved by 2 replicas training apart; this model does not train apart: make its "
            "LocalSGD or DiLoCo before the load to resume each replica's own state)");
  expect_same(weights(one_replica), weights(plain), "restarted from the global state");
  const auto [x, y] = batch(6);
  torch::mse_loss(one_replica(local_rows(x, r.rank, 2)), local_rows(y, r.rank, 2)).backward();
  diloco.step();
  EXPECT_EQ(diloco.inner_steps(), 5);
  // DiLoCo's checkpoint (H 4, saved at inner step 6) loaded by a LocalSGD of H 6 on 2 replicas:
  // each replica its own state, and the change said.
  torch::manual_seed(1);
  auto other = fully_shard(std::make_shared<MLP>(), r.pg, test_options(ShardingStrategy::kHybridShard, 1));
  torch::optim::AdamW inner4(other.parameters(), 1e-2);
  optim::LocalSGD local6(other, inner4, optim::LocalSGDOptions(6));
  EXPECT_EQ(checkpoint::load(dir + "/diloco", other, inner4).replicas,
            "each of the 2 replicas its own state, at inner step 6; saved by DiLoCo every 4 steps, loaded by "
            "LocalSGD every 6: DiLoCo's outer state is not used");
}

TEST(LocalSGD, CheckpointsKeepEachReplicaApart) {
  CheckpointRoot root;  // shared by the two launches
  run_ranks(
      kWorld, [](Rank& r) { save_and_resume_on_the_same_replicas(r); }, root.options);
  run_ranks(
      2, [](Rank& r) { resume_on_other_ranks(r); }, root.options);
}

TEST(LocalSGD, ReplicasTrainApartAndAverage) {
  run_ranks(kWorld, [](Rank& r) {
    local_sgd_h1_is_hybrid(r);
    local_sgd_h4_matches_reference(r, 1);
    local_sgd_h4_matches_reference(r, 2);
    local_sgd_h4_matches_reference(r, 2, /*overlap=*/true);
    diloco_against_local_sgd(r);
    refusals(r);
  });
}

}  // namespace
}  // namespace fsdp::testing
