// A sampler's state in the sharded checkpoint: saved by 2 ranks (manifest "data"), restored on 3
// with the model and the optimizer; ranks whose samplers disagree fail the save on every rank and
// commit nothing; a sampler of another seed, or a checkpoint without a state, fails the load on
// every rank before the model, the optimizer or the sampler changes.
#include "data/distributed_sampler.h"
#include "tests/checkpoint_helpers.h"

#include <fstream>

namespace fsdp::testing {
namespace {

using data::DistributedSampler;
using data::SamplerOptions;

constexpr int64_t kSamples = 1000;
constexpr uint64_t kSeed = (uint64_t{1} << 63) + 21;  // past int64: the manifest keeps it unsigned
const Case kFull{"full", ShardingStrategy::kFullShard, 0, false};

DistributedSampler sampler_of(const Rank& r, uint64_t seed, int shares) {
  DistributedSampler s(kSamples, r.rank, r.world_size, SamplerOptions(12).seed(seed));
  for (int taken = 0; taken < shares;) taken += s.next_share() ? 1 : 0;  // an epoch's end takes none
  return s;
}

void save_with_sampler(Rank& r) {
  const std::string root = root_dir();
  auto model = wrap(kFull, r, 7);
  auto opt = make_opt(Opt::kAdamW, model);
  train_step(model, *opt, r, 0);
  const auto s = sampler_of(r, kSeed, 90);  // past the first epoch (83 global batches of 12)
  ASSERT_EQ(s.state().epoch, 1);
  checkpoint::save(root, model, *opt, checkpoint::SaveOptions().name("with-data").sampler_state(s.state()));
  checkpoint::save(root, model, *opt, checkpoint::SaveOptions().name("no-data"));
  if (r.rank == 0) {
    std::ifstream f(root + "/with-data/manifest.json");
    const auto j = nlohmann::json::parse(f);
    EXPECT_EQ(j["format_version"], checkpoint::kFormatVersion);
    EXPECT_EQ(j["data"]["seed"].get<uint64_t>(), kSeed);
    EXPECT_EQ(j["data"]["dataset_size"], kSamples);
    EXPECT_EQ(j["data"]["epoch"], 1);
    EXPECT_EQ(j["data"]["position"], (90 - 83) * 12);
    EXPECT_EQ(j["data"]["samples_consumed"], 90 * 12);  // the epoch's 4 dropped samples are not consumed
  }
  if (r.rank == 0) {
    // A version-1 checkpoint (no "data") reads as one without a state; a malformed "data" is refused.
    copy_checkpoint(root + "/with-data", root + "/v1");
    edit_manifest(root + "/v1", [](nlohmann::json& j) {
      j["format_version"] = 1;
      j.erase("data");
    });
    copy_checkpoint(root + "/with-data", root + "/bad-data");
    edit_manifest(root + "/bad-data", [](nlohmann::json& j) { j["data"]["position"] = "ten"; });
  }
  // Rank 1 took one more global batch: every rank fails, naming it, and nothing is committed.
  const auto off = sampler_of(r, kSeed, r.rank == 1 ? 91 : 90);
  const std::string msg = error_of([&] {
    checkpoint::save(root, model, *opt, checkpoint::SaveOptions().name("disagree").sampler_state(off.state()));
  });
  EXPECT_NE(msg.find("the data sampler's state differs between ranks"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 1 has"), std::string::npos) << msg;
  struct stat st {};
  EXPECT_NE(::stat((root + "/disagree").c_str(), &st), 0) << "nothing committed";
}

void load_with_sampler(Rank& r) {
  const std::string root = root_dir();
  const auto want = sampler_of(r, kSeed, 90).state();  // the same global state on any number of ranks
  {
    auto model = wrap(kFull, r, 1234);
    auto opt = make_opt(Opt::kAdamW, model);
    DistributedSampler s(kSamples, r.rank, r.world_size, SamplerOptions(12).seed(kSeed));
    const auto res = checkpoint::load(root + "/with-data", model, *opt, checkpoint::LoadOptions().sampler(&s));
    EXPECT_EQ(s.state(), want);
    ASSERT_TRUE(res.sampler_state.has_value());
    EXPECT_EQ(*res.sampler_state, want);
    // The next global batch is the one the saving run would have taken next.
    auto uninterrupted = sampler_of(Rank{0, 1, nullptr}, kSeed, 90);
    auto whole = uninterrupted.next_share()->indices;
    auto mine = s.next_share()->indices;
    EXPECT_EQ(mine, std::vector<int64_t>(whole.begin() + 4 * r.rank, whole.begin() + 4 * (r.rank + 1)));
  }
  // Another seed, and a checkpoint without a state: refused on every rank, nothing changed.
  for (const auto& [dir, seed, expect] : std::vector<std::tuple<std::string, uint64_t, std::string>>{
           {"with-data", 22, "the state was saved with seed 9223372036854775829, this sampler has seed 22"},
           {"bad-data", kSeed, "has a \"data\" entry that is not a sampler's state"},
           {"no-data", 21, "holds no data sampler state (it was saved without SaveOptions::sampler_state)"}}) {
    auto model = wrap(kFull, r, 1234);
    auto opt = make_opt(Opt::kAdamW, model);
    const auto before = model.full_state_dict();
    auto s = sampler_of(r, seed, 2);
    const auto state = s.state();
    const std::string msg =
        error_of([&] { checkpoint::load(root + "/" + dir, model, *opt, checkpoint::LoadOptions().sampler(&s)); });
    EXPECT_NE(msg.find(expect), std::string::npos) << msg;
    EXPECT_EQ(s.state(), state);
    expect_bit_exact(model.full_state_dict(), before, dir);
    EXPECT_TRUE(opt->state().empty()) << dir;
  }
  // Without a sampler to restore, the saved state is still reported.
  auto model = wrap(kFull, r, 1234);
  EXPECT_EQ(checkpoint::load(root + "/with-data", model).sampler_state, want);
  EXPECT_FALSE(checkpoint::load(root + "/no-data", model).sampler_state.has_value());
  EXPECT_FALSE(checkpoint::load(root + "/v1", model).sampler_state.has_value());
  // A sampler restored on some ranks only: the ranks took different paths, refused on every rank
  // at the first agreement, before anything is read (the model is then unusable: restart).
  auto s = sampler_of(r, kSeed, 2);
  const std::string msg = error_of([&] {
    checkpoint::LoadOptions o;
    if (r.rank == 0) o.sampler(&s);
    checkpoint::load(root + "/with-data", model, o);
  });
  EXPECT_NE(msg.find("the ranks took different paths"), std::string::npos) << msg;
  EXPECT_NE(msg.find("with a data sampler to restore"), std::string::npos) << msg;
  EXPECT_EQ(s.state().position, 24);
}

TEST(DataCheckpoint, SamplerStateSavedOnTwoRanksRestoredOnThree) {
  CheckpointRoot root;
  run_ranks(2, save_with_sampler, root.options);
  run_ranks(3, load_with_sampler, root.options);
}

}  // namespace
}  // namespace fsdp::testing
