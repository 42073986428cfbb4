// The examples' fused kernels against the arithmetic they replaced (Config::reference_path): the GPT's
// attention through at::scaled_dot_product_attention; the Llama's at::rms_norm, SDPA's enable_gqa
// and its rotary tables cached on the device. Same seed, same batch: the losses agree to 1e-6
// relative in fp32 over a few AdamW steps, and so do the gradients of the first step.
#include "examples/llama/llama.h"
#include "tests/parity.h"

namespace fsdp::testing {
namespace {

/// Trains `make(reference)` for 3 AdamW steps on the same batches, with and without the reference
/// path, comparing the losses every step and the first step's gradients. `loss(model, x, y)`.
template <typename Make, typename Loss>
void expect_same_training(Make make, Loss loss, int64_t vocab, int64_t T, const std::string& what) {
  auto ref = make(true), fused = make(false);
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW fused_opt(fused->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(300 + step);
    auto tok = torch::randint(vocab, {4, T + 1}, torch::kLong);
    auto x = tok.narrow(1, 0, T), y = tok.narrow(1, 1, T);
    ref_opt.zero_grad();
    fused_opt.zero_grad();
    auto a = loss(ref, x, y), b = loss(fused, x, y);
    a.backward();
    b.backward();
    EXPECT_TRUE(close(b.detach(), a.detach(), 1e-6)) << what << ": loss at step " << step;
    if (step == 0) {
      const auto ga = ref->named_parameters(), gb = fused->named_parameters();
      ASSERT_EQ(ga.size(), gb.size());
      for (const auto& kv : ga) {
        EXPECT_TRUE(close(gb[kv.key()].grad(), kv.value().grad(), 1e-5)) << what << ": gradient of " << kv.key();
      }
    }
    ref_opt.step();
    fused_opt.step();
  }
}

TEST(Gpt, SdpaMatchesReferencePath) {
  for (const int64_t layers : {1, 3}) {
    gpt::Config cfg{61, 16, layers, 4, 32, /*bias=*/true};
    expect_same_training(
        [&](bool reference) {
          auto c = cfg;
          c.reference_path = reference;
          torch::manual_seed(11);
          return gpt::make_gpt<false>(c);
        },
        [](auto& m, const torch::Tensor& x, const torch::Tensor& y) { return gpt_loss(m->forward(x), y); },
        cfg.vocab_size, cfg.block_size, "GPT, " + std::to_string(layers) + " layer(s)");
  }
}

llama::Config llama_config(int64_t kv_heads, bool tied, bool sp) {
  llama::Config c;
  c.vocab_size = 64;
  c.block_size = 12;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = kv_heads;
  c.n_embd = 32;
  c.intermediate = 48;
  c.tie_word_embeddings = tied;
  c.sequence_parallel = sp;
  return c;
}

void check_llama(Rank& r, const llama::Config& base, const std::string& what) {
  const fsdp::tp::Group g(r.pg);
  expect_same_training(
      [&](bool reference) {
        auto c = base;
        c.reference_path = reference;
        torch::manual_seed(5);
        return llama::LlamaForCausalLM(c, g, g).ptr();
      },
      [](auto& m, const torch::Tensor& x, const torch::Tensor& y) { return m->loss(x, y); }, base.vocab_size,
      base.block_size, what + " at tensor-parallel size " + std::to_string(r.world_size));
}

// One process (grouped-query attention at 2 of 4 key-value heads and 1 of 4, plain multi-head,
// tied), then 2 ranks of tensor parallelism (each rank 1 key-value head of its 2 query heads, and
// sequence parallelism, where the norms see half the positions).
TEST(Llama, SdpaMatchesReferencePath) {
  run_ranks(1, [](Rank& r) {
    check_llama(r, llama_config(2, false, false), "GQA 4/2");
    check_llama(r, llama_config(1, true, false), "GQA 4/1, tied");
    check_llama(r, llama_config(4, false, false), "multi-head");
  });
  run_ranks(2, [](Rank& r) {
    check_llama(r, llama_config(2, false, false), "GQA 4/2");
    check_llama(r, llama_config(2, false, true), "GQA 4/2, sequence parallel");
  });
}

// bf16: at::rms_norm rounds once where transformers rounds before the weight's product, so the
// two agree to bf16's precision, not bit for bit.
TEST(Llama, FusedRmsNormInBf16WithinItsPrecision) {
  torch::manual_seed(2);
  auto x = torch::randn({3, 5, 64}).to(torch::kBFloat16);
  llama::RMSNorm fused(64, 1e-5), ref(64, 1e-5, std::nullopt, /*reference=*/true);
  {
    torch::NoGradGuard no_grad;
    auto w = torch::rand({64}) + 0.5;
    fused->weight.copy_(w);
    ref->weight.copy_(w);
  }
  fused->to(torch::kBFloat16);
  ref->to(torch::kBFloat16);
  const auto a = fused(x), b = ref(x);
  EXPECT_EQ(a.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(close(a.to(torch::kFloat), b.to(torch::kFloat), 1e-2));
}

// What the Llama's GPU path (bf16 flash with enable_gqa) relies on: SDPA's enable_gqa pairs each
// key-value head with heads / kv_heads consecutive query heads, as the Llama's repeat by copies
// does (run here through the math path, which takes enable_gqa on the CPU).
TEST(Llama, GqaInPlacePairsHeadsAsTheRepeatedCopies) {
  torch::manual_seed(4);
  const int64_t B = 2, H = 6, KV = 2, T = 5, D = 8, rep = H / KV;
  auto q = torch::randn({B, H, T, D}), k = torch::randn({B, KV, T, D}), v = torch::randn({B, KV, T, D});
  auto repeated = [&](const torch::Tensor& t) {
    return t.unsqueeze(2).expand({B, KV, rep, T, D}).reshape({B, H, T, D});
  };
  const auto in_place = at::scaled_dot_product_attention(q, k, v, {}, 0.0, true, std::nullopt, /*enable_gqa=*/true);
  const auto copies = at::scaled_dot_product_attention(q, repeated(k), repeated(v), {}, 0.0, true);
  EXPECT_TRUE(close(in_place, copies, 1e-6));
}

// The tables are computed once per (length, device, dtype): the same tensors again, and equal to
// the reference's, built on the CPU then cast.
TEST(Llama, RotaryTablesComputedOnce) {
  llama::RotaryTables tables(16, 10000.0);
  const auto a = tables.get(12, torch::kCPU, torch::kFloat), b = tables.get(12, torch::kCPU, torch::kFloat);
  EXPECT_EQ(a.first.data_ptr(), b.first.data_ptr());
  EXPECT_EQ(a.second.data_ptr(), b.second.data_ptr());
  const auto [cos, sin] = llama::rotary(12, 16, 10000.0);
  EXPECT_TRUE(torch::equal(a.first, cos));
  EXPECT_TRUE(torch::equal(a.second, sin));
  const auto half = tables.get(12, torch::kCPU, torch::kBFloat16), shorter = tables.get(7, torch::kCPU, torch::kFloat);
  EXPECT_NE(half.first.data_ptr(), a.first.data_ptr());
  EXPECT_TRUE(torch::equal(half.first, cos.to(torch::kBFloat16)));
  EXPECT_TRUE(torch::equal(shorter.first, cos.narrow(0, 0, 7)));
  EXPECT_FALSE(a.first.requires_grad());
}

}  // namespace
}  // namespace fsdp::testing
