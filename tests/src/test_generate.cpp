// Generation with a KV cache (src/infer/): greedy decoding with the cache equals decoding that
// prefills the whole sequence again for every token; the prefill's logits equal the training
// forward's (through its per-row losses); sampling is seeded and deterministic; a batch of
// left-padded prompts gives each prompt's tokens alone; offloaded weights give the resident
// tokens. All fp32 on the CPU backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <span>
#include <vector>

#include "src/infer/generate.h"
#include "src/infer/generator.h"
#include "src/infer/sampler.h"
#include "offload/manager.h"
#include "tests/src/model_test_util.h"

namespace strata {
namespace {

ModelConfig gen_llama(bool qwen2) {
  ModelConfig c;
  c.family = Family::llama;
  c.model_type = qwen2 ? "qwen2" : "llama";
  c.vocab_size = 37;
  c.hidden_size = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;  // GQA
  c.intermediate_size = 48;
  c.max_position_embeddings = 64;
  c.attention_bias = qwen2;  // qwen2: q/k/v bias
  return c;
}

ModelConfig gen_gpt2() {
  ModelConfig c;
  c.family = Family::gpt2;
  c.model_type = "gpt2";
  c.vocab_size = 41;
  c.hidden_size = 24;
  c.n_layers = 2;
  c.n_heads = 3;
  c.n_kv_heads = 3;
  c.intermediate_size = 96;
  c.max_position_embeddings = 64;
  c.tie_word_embeddings = true;
  c.activation = "gelu_new";
  return c;
}

// fp32 weights of every unit: GPT-2 init (seed 7) with matrices scaled up, so the logits are far
// from ties and greedy choices do not hinge on rounding. Biases get small random values.
std::vector<std::vector<float>> test_weights(const Transformer& layout) {
  std::vector<std::vector<float>> w;
  for (size_t u = 0; u < layout.units().size(); ++u) {
    std::vector<float> m(static_cast<size_t>(layout.units()[u].numel), 0.f);
    layout.init_unit(static_cast<int>(u), 7, m.data());
    for (int pi : layout.units()[u].params) {
      const ParamInfo& p = layout.params()[static_cast<size_t>(pi)];
      for (int64_t i = 0; i < p.numel; ++i) {
        float& x = m[static_cast<size_t>(p.unit_offset + i)];
        if (p.zeros) x = 0.01f * static_cast<float>((i * 37 + pi) % 11 - 5);
        else if (!p.ones) x *= 10.f;
      }
    }
    w.push_back(std::move(m));
  }
  return w;
}

struct Fixture {
  std::unique_ptr<kernels::Runtime> rt = kernels::make_runtime(kernels::Backend::cpu);
  std::unique_ptr<kernels::Stream> s = rt->create_stream();
  std::unique_ptr<Generator> gen;
  Fixture(const ModelConfig& cfg, GenerateShape shape, WeightPlacement pl = {}) {
    gen = std::make_unique<Generator>(cfg, DType::f32, *rt, *s, pl, shape);
    const auto w = test_weights(gen->layout());
    for (size_t u = 0; u < w.size(); ++u) gen->set_unit(static_cast<int>(u), w[u]);
  }
};

std::vector<int32_t> prompt_of(int64_t n, int64_t vocab, int salt = 0) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < n; ++i) p.push_back(static_cast<int32_t>((i * 5 + 3 + salt * 11) % vocab));
  return p;
}

std::vector<int32_t> greedy(Generator& g, const std::vector<int32_t>& prompt, int64_t n) {
  SamplingParams sp;
  sp.temperature = 0;
  return generate(g, {{prompt, n}}, sp, {}).at(0).ids;
}

class GreedyCache : public ::testing::TestWithParam<int> {};

ModelConfig config_of(int i) { return i == 0 ? gen_llama(false) : i == 1 ? gen_llama(true) : gen_gpt2(); }

// The reference recomputes everything: a fresh prefill of prompt + tokens so far (the generator's
// prefill path, no cached keys) for every token; the cached run must pick the same tokens, and
// its step logits equal the recomputed ones to fp32 rounding.
TEST_P(GreedyCache, EqualsFullRecompute) {
  const ModelConfig cfg = config_of(GetParam());
  const int64_t P = 5, n = 12;
  Fixture cached(cfg, {1, P, P + n});
  Fixture full(cfg, {1, P + n, P + n});
  const std::vector<int32_t> prompt = prompt_of(P, cfg.vocab_size);
  std::vector<int32_t> seq = prompt;
  const std::vector<float>* lc = &cached.gen->prefill({prompt});
  for (int64_t t = 0; t < n; ++t) {
    const std::vector<float>& lf = full.gen->prefill({seq});
    ASSERT_EQ(lc->size(), lf.size());
    float worst = 0;
    for (size_t i = 0; i < lf.size(); ++i) worst = std::max(worst, std::abs((*lc)[i] - lf[i]));
    EXPECT_LT(worst, 1e-4f) << "token " << t;
    const int32_t tok = argmax(lf);
    ASSERT_EQ(argmax(*lc), tok) << "token " << t;
    seq.push_back(tok);
    if (t + 1 < n) lc = &cached.gen->step({tok});
  }
  // And the sampling loop gives the same tokens.
  Fixture again(cfg, {1, P, P + n});
  EXPECT_EQ(greedy(*again.gen, prompt, n), std::vector<int32_t>(seq.begin() + P, seq.end()));
}

// The prefill's last-row logits give the training forward's loss for each prefix: the decode
// path and the training path compute the same model.
TEST_P(GreedyCache, PrefillMatchesTrainingForward) {
  const ModelConfig cfg = config_of(GetParam());
  const int64_t T = 9;
  Fixture f(cfg, {1, T, T});
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  TestModel m(cfg, DType::f32, 1, T, *rt);
  const auto w = test_weights(f.gen->layout());
  for (size_t u = 0; u < w.size(); ++u) std::copy(w[u].begin(), w[u].end(), m.master() + m.units()[u].offset);
  const std::vector<int32_t> ids = prompt_of(T, cfg.vocab_size, 1);
  std::vector<int32_t> targets(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) targets[static_cast<size_t>(t)] = static_cast<int32_t>((t * 3 + 1) % cfg.vocab_size);
  m.sync_weights();
  m.forward(ids.data(), targets.data());
  m.synchronize();
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<float>& l = f.gen->prefill({std::vector<int32_t>(ids.begin(), ids.begin() + t + 1)});
    double mx = -1e30, sum = 0;
    for (float x : l) mx = std::max(mx, static_cast<double>(x));
    for (float x : l) sum += std::exp(x - mx);
    const double loss = mx + std::log(sum) - l[static_cast<size_t>(targets[static_cast<size_t>(t)])];
    EXPECT_NEAR(loss, m.loss_rows()[t], 1e-4 * std::max(1.0, std::abs(loss))) << "position " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, GreedyCache, ::testing::Values(0, 1, 2),
                         [](const auto& i) { return std::string(i.param == 0 ? "llama" : i.param == 1 ? "qwen2" : "gpt2"); });

TEST(Sampling, SeededAndTopKOneIsGreedy) {
  const ModelConfig cfg = gen_llama(false);
  const std::vector<int32_t> prompt = prompt_of(4, cfg.vocab_size);
  auto run = [&](SamplingParams sp) {
    Fixture f(cfg, {1, 4, 4 + 24});
    return generate(*f.gen, {{prompt, 24}}, sp, {}).at(0).ids;
  };
  SamplingParams sp;
  sp.temperature = 3.0;  // flat enough that two seeds part ways
  sp.seed = 1;
  const auto a = run(sp), b = run(sp);
  EXPECT_EQ(a, b);
  sp.seed = 2;
  EXPECT_NE(run(sp), a);
  sp.top_k = 1;
  SamplingParams g;
  g.temperature = 0;
  EXPECT_EQ(run(sp), run(g));
}

TEST(Sampling, TopPAndTopKKeepTheHead) {
  // p = softmax([3, 2, 1, 0]) = .644 .237 .087 .032
  const std::vector<float> logits{1.f, 3.f, 0.f, 2.f};
  std::vector<std::pair<double, int32_t>> scratch;
  SampleRng rng(5);
  SamplingParams sp;
  sp.top_p = 0.6;  // the first token alone reaches it
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sample_token(logits, sp, rng, scratch), 1);
  sp.top_p = 0.7;  // needs the second one too
  sp.top_k = 0;
  int seen3 = 0;
  for (int i = 0; i < 200; ++i) {
    const int32_t t = sample_token(logits, sp, rng, scratch);
    EXPECT_TRUE(t == 1 || t == 3);
    seen3 += t == 3;
  }
  EXPECT_GT(seen3, 20);
  sp.top_p = 1.0;
  sp.top_k = 2;
  for (int i = 0; i < 100; ++i) {
    const int32_t t = sample_token(logits, sp, rng, scratch);
    EXPECT_TRUE(t == 1 || t == 3);
  }
  EXPECT_THROW((SamplingParams{1.0, 0, 1.5, 0}).validate(), std::invalid_argument);
  EXPECT_THROW((SamplingParams{-1.0, 0, 1.0, 0}).validate(), std::invalid_argument);
  // The generator's stream is fixed by the seed (the same bits on any machine).
  SampleRng r(42);
  EXPECT_EQ(r.next_u64(), 0xbdd732262feb6e95ULL);
}

// Prompts of different lengths and token limits in one left-padded batch: each gets the tokens
// it gets alone (greedy, fp32). The logits agree to fp32 rounding (the batch's matmuls have more
// rows), which for these well-separated logits makes the tokens identical.
TEST(Batched, EqualsEachPromptAlone) {
  for (const ModelConfig& cfg : {gen_llama(true), gen_gpt2()}) {
    const std::vector<GenRequest> reqs{{prompt_of(3, cfg.vocab_size, 1), 6},
                                       {prompt_of(8, cfg.vocab_size, 2), 4},
                                       {prompt_of(5, cfg.vocab_size, 3), 7}};
    Fixture batch(cfg, {3, 8, 8 + 7});
    SamplingParams sp;
    sp.temperature = 0;
    const std::vector<GenResult> got = generate(*batch.gen, reqs, sp, {});
    for (size_t i = 0; i < reqs.size(); ++i) {
      const auto n = static_cast<int64_t>(reqs[i].prompt.size());
      Fixture alone(cfg, {1, n, n + reqs[i].max_new_tokens});
      EXPECT_EQ(got[i].ids, greedy(*alone.gen, reqs[i].prompt, reqs[i].max_new_tokens)) << cfg.model_type << " " << i;
      EXPECT_EQ(got[i].finish, "length");
    }
  }
}

TEST(Batched, EosFinishesAnItem) {
  const ModelConfig cfg = gen_llama(false);
  const std::vector<int32_t> prompt = prompt_of(4, cfg.vocab_size);
  Fixture f(cfg, {1, 4, 4 + 10});
  const std::vector<int32_t> all = greedy(*f.gen, prompt, 10);
  Fixture g(cfg, {1, 4, 4 + 10});
  SamplingParams sp;
  sp.temperature = 0;
  const GenResult r = generate(*g.gen, {{prompt, 10}}, sp, {all[3]}).at(0);
  const auto first = std::find(all.begin(), all.end(), all[3]);
  EXPECT_EQ(r.ids, std::vector<int32_t>(all.begin(), first));
  EXPECT_EQ(r.finish, "eos");
}

// Weights homed in pinned host RAM or on NVMe (a temp dir), streamed one unit at a time with a
// tight host budget: the resident tokens.
TEST(Offload, SameTokensAsResident) {
  const ModelConfig cfg = gen_llama(true);
  const std::vector<int32_t> prompt = prompt_of(6, cfg.vocab_size);
  Fixture resident(cfg, {1, 6, 6 + 8});
  const std::vector<int32_t> want = greedy(*resident.gen, prompt, 8);
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "strata_generate_nvme";
  std::filesystem::create_directories(dir);
  for (offload::Tier t : {offload::Tier::host, offload::Tier::nvme}) {
    WeightPlacement pl;
    pl.params = t;
    if (t == offload::Tier::nvme) {
      pl.nvme_paths = {dir.string()};
      // Room for the two largest units (a block in use and the next): the rest stays on NVMe.
      auto rt = kernels::make_runtime(kernels::Backend::cpu);
      const Transformer layout(cfg, DType::f32, 1, 1, *rt);
      for (const Unit& u : layout.units()) pl.host_mem = std::max<uint64_t>(pl.host_mem, 2 * 4 * u.numel);
    }
    Fixture f(cfg, {1, 6, 6 + 8}, pl);
    EXPECT_EQ(greedy(*f.gen, prompt, 8), want) << offload::tier_name(t);
    if (t == offload::Tier::nvme) {  // streamed from NVMe every forward
      EXPECT_GT(f.gen->manager().stats().link(offload::Link::nvme_to_host).bytes, 0u);
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(Generator, RejectsWhatDoesNotFit) {
  const ModelConfig cfg = gen_llama(false);
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  auto s = rt->create_stream();
  EXPECT_THROW(Generator(cfg, DType::f32, *rt, *s, {}, {1, 8, 65}), std::invalid_argument);  // > max positions
  WeightPlacement nv;
  nv.params = offload::Tier::nvme;  // no --nvme-path
  EXPECT_THROW(Generator(cfg, DType::f32, *rt, *s, nv, {1, 8, 16}), std::invalid_argument);
  Generator g(cfg, DType::f32, *rt, *s, {}, {1, 4, 6});
  g.init_random(1);
  EXPECT_THROW(g.prefill({{1, 2, 99}}), std::out_of_range);  // id outside the vocab
  g.prefill({{1, 2}});
  for (int i = 0; i < 4; ++i) g.step({1});
  EXPECT_THROW(g.step({1}), std::invalid_argument);  // cache full
}

}  // namespace
}  // namespace strata
