// The optimizer pieces and the trainer: LR schedules, AdamW against a float64 torch.optim.AdamW
// (decay on 2-D ranges only), global norm and clipping as clip_grad_norm_, the fp16 loss
// scaler, the embedded corpus, and save -> load -> save being bit-exact in HF layout.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include "kernels/runtime.h"
#include "src/checkpoint/hf.h"
#include "src/optim/adamw.h"
#include "src/optim/schedule.h"
#include "src/train/corpus.h"
#include "src/train/gpu_specs.h"
#include "src/train/perf_model.h"
#include "src/train/step_driver.h"
#include "src/train/trainer.h"
#include "src/zero/step_program.h"
#include "src/zero/unit_table.h"

using namespace strata;
namespace fs = std::filesystem;

namespace {

fs::path make_temp_dir() {
  std::string t = (fs::path(::testing::TempDir()) / "strata_train_XXXXXX").string();
  EXPECT_NE(::mkdtemp(t.data()), nullptr);
  return t;
}

TEST(Schedule, WarmupCosineConstant) {
  LrScheduleConfig c{LrSchedule::cosine, 1e-3, 1e-4, 10, 111};  // cosine over steps 10..110
  EXPECT_DOUBLE_EQ(lr_at(c, 0), 1e-4);
  EXPECT_DOUBLE_EQ(lr_at(c, 4), 5e-4);
  EXPECT_DOUBLE_EQ(lr_at(c, 9), 1e-3);
  EXPECT_DOUBLE_EQ(lr_at(c, 10), 1e-3);                    // cosine starts at the peak
  EXPECT_NEAR(lr_at(c, 60), 5.5e-4, 1e-15);                // half way: the mean of peak and floor
  EXPECT_DOUBLE_EQ(lr_at(c, 110), 1e-4);                   // last step: the floor
  c.kind = LrSchedule::constant;
  EXPECT_DOUBLE_EQ(lr_at(c, 50), 1e-3);
  EXPECT_DOUBLE_EQ(lr_at(c, 2), 3e-4);
  EXPECT_EQ(parse_lr_schedule("cosine"), LrSchedule::cosine);
  EXPECT_THROW(parse_lr_schedule("linear"), std::invalid_argument);
}

TEST(Optim, ClipCoefficientAsTorch) {
  EXPECT_FLOAT_EQ(clip_coefficient(10.0, 1.0), static_cast<float>(1.0 / (10.0 + 1e-6)));
  EXPECT_FLOAT_EQ(clip_coefficient(0.5, 1.0), 1.f);
  EXPECT_FLOAT_EQ(clip_coefficient(100.0, 0.0), 1.f);  // 0 = off
}

TEST(Optim, LossScalerSkipsAndRegrows) {
  LossScaler s(true, 1024.f, 3);
  EXPECT_FALSE(s.update(false));
  EXPECT_FLOAT_EQ(s.scale(), 512.f);
  EXPECT_TRUE(s.update(true));
  EXPECT_TRUE(s.update(true));
  EXPECT_TRUE(s.update(true));
  EXPECT_FLOAT_EQ(s.scale(), 1024.f);
  LossScaler off(false);
  EXPECT_TRUE(off.update(false));
  EXPECT_FLOAT_EQ(off.scale(), 1.f);
}

// AdamW over two ranges (a 2-D one with decay, a 1-D one without), three steps with a grad scale,
// against torch.optim.AdamW's update in float64.
TEST(Optim, AdamWMatchesTorchFormulaInFloat64) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  auto s = rt->create_stream();
  const int64_t n = 300, split = 200;
  kernels::DeviceBuffer p(*rt, n * 4), g(*rt, n * 4), copy(*rt, n * 2);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<double> rp(n), rm(n, 0), rv(n, 0);
  for (int64_t i = 0; i < n; ++i) rp[static_cast<size_t>(i)] = p.as<float>()[i] = nd(rng);
  AdamWConfig cfg{0.9f, 0.95f, 1e-8f, 0.1f};
  std::vector<float> m(n, 0.f), v(n, 0.f);
  const float lr = 1e-2f, gs = 0.5f;
  for (int step = 1; step <= 3; ++step) {
    for (int64_t i = 0; i < n; ++i) g.as<float>()[i] = nd(rng);
    const AdamWStep st{cfg, step, lr, gs};
    auto* c16 = static_cast<uint16_t*>(copy.data());
    adamw_range(rt->ops(), *s, st, true, split, p.as<float>(), m.data(), v.data(), g.as<float>(), c16,
                kernels::DType::bf16);
    adamw_range(rt->ops(), *s, st, false, n - split, p.as<float>() + split, m.data() + split, v.data() + split,
                g.as<float>() + split, c16 + split, kernels::DType::bf16);
    s->synchronize();
    for (int64_t i = 0; i < n; ++i) {
      const size_t k = static_cast<size_t>(i);
      const double gr = static_cast<double>(g.as<float>()[i]) * gs;
      if (i < split) rp[k] -= static_cast<double>(lr) * 0.1 * rp[k];
      rm[k] = 0.9 * rm[k] + 0.1 * gr;
      rv[k] = 0.95 * rv[k] + 0.05 * gr * gr;
      const double mhat = rm[k] / (1 - std::pow(0.9, step)), vhat = rv[k] / (1 - std::pow(0.95, step));
      rp[k] -= lr * mhat / (std::sqrt(vhat) + 1e-8);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(p.as<float>()[i], rp[static_cast<size_t>(i)], 2e-6 * (1 + std::abs(rp[static_cast<size_t>(i)]))) << i;
    ASSERT_EQ(reinterpret_cast<uint16_t*>(copy.data())[i], kernels::f32_to_bf16(p.as<float>()[i])) << i;
  }
}

TEST(Corpus, DeterministicByteText) {
  const std::string a = embedded_corpus_text(5000), b = embedded_corpus_text(5000);
  EXPECT_EQ(a, b);
  EXPECT_GE(a.size(), 5000u);
  EXPECT_NE(a.find("said"), std::string::npos);
  EmbeddedCorpusShard shard;
  EXPECT_GT(shard.n_tokens(), 200000);
  EXPECT_TRUE(fs::exists(shard.path()));
}

ModelConfig tiny_byte_llama() {
  ModelConfig c = default_model_config();
  c.hidden_size = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 8;
  c.intermediate_size = 64;
  c.max_position_embeddings = 64;
  return c;
}

// Train two steps, save; a trainer loading that directory saves bit-identical files, and the
// saved tensors have HF names and shapes.
TEST(Trainer, SaveLoadSaveIsBitExact) {
  const fs::path dir = make_temp_dir();
  for (const ModelConfig& cfg : {tiny_byte_llama(), preset_model_config("gpt2-124m")}) {
    const bool gpt2 = cfg.family == Family::gpt2;
    ModelConfig c = cfg;
    if (gpt2) {  // shrink the preset, keep its family
      c.hidden_size = 24, c.n_layers = 1, c.n_heads = 2, c.n_kv_heads = 2, c.head_dim = 12, c.intermediate_size = 96, c.vocab_size = 300;
      c.max_position_embeddings = 32;
    }
    fs::create_directories(dir / "init");
    write_hf_config(c, dir / "init" / "config.json");
    TrainOptions o;
    o.model = (dir / "init").string();
    o.batch = 2, o.seq = 16, o.steps = 2, o.warmup = 0;
    o.out = (dir / "a").string();
    o.metrics = (dir / "m.jsonl").string();
    std::FILE* devnull = std::fopen("/dev/null", "w");
    Trainer(o).run(devnull);
    TrainOptions o2 = o;
    o2.model = o.out;
    o2.out = "";
    Trainer(o2).save((dir / "b").string());
    std::fclose(devnull);
    for (const auto& e : fs::directory_iterator(dir / "a")) {
      if (e.path().extension() != ".safetensors") continue;
      std::ifstream fa(e.path(), std::ios::binary), fb(dir / "b" / e.path().filename(), std::ios::binary);
      std::stringstream sa, sb;
      sa << fa.rdbuf();
      sb << fb.rdbuf();
      EXPECT_GT(sa.str().size(), 1000u);
      EXPECT_TRUE(sa.str() == sb.str()) << e.path();
    }
    auto ck = HfCheckpoint::open(dir / "a");
    if (gpt2) {
      const StoredTensor* t = ck->find("transformer.h.0.attn.c_attn.weight");
      ASSERT_NE(t, nullptr);
      EXPECT_EQ(t->shape, (std::vector<int64_t>{24, 72}));
      EXPECT_EQ(ck->find("lm_head.weight"), nullptr);
    } else {
      EXPECT_NE(ck->find("model.layers.1.mlp.gate_proj.weight"), nullptr);
      EXPECT_NE(ck->find("lm_head.weight"), nullptr);
    }
    EXPECT_EQ(read_hf_config(dir / "a" / "config.json").n_layers, c.n_layers);
    fs::remove_all(dir / "a"), fs::remove_all(dir / "b"), fs::remove_all(dir / "init");
  }
  fs::remove_all(dir);
}

// --lr 0 (allowed, as in torch.optim.AdamW) trains nothing: weight decay is lr·wd·p, so the
// saved weights are the initial ones bit for bit; a negative lr is an error.
TEST(Trainer, ZeroLrLeavesWeightsUnchanged) {
  const fs::path dir = make_temp_dir();
  TrainOptions o;
  o.batch = 2, o.seq = 16, o.warmup = 0, o.lr_schedule = "constant";
  o.steps = 1, o.lr = 1.0;  // any lr: only the init is saved below
  std::FILE* devnull = std::fopen("/dev/null", "w");
  Trainer(o).save((dir / "init").string());
  o.lr = 0, o.min_lr = 0, o.steps = 3, o.weight_decay = 0.5;
  o.out = (dir / "after").string() + "/";  // a trailing '/' names the same directory
  Trainer(o).run(devnull);
  std::fclose(devnull);
  auto a = HfCheckpoint::open(dir / "init");
  auto b = HfCheckpoint::open(dir / "after");
  ASSERT_EQ(a->tensors().size(), b->tensors().size());
  for (const StoredTensor& t : a->tensors()) {
    const StoredTensor* u = b->find(t.name);
    ASSERT_NE(u, nullptr) << t.name;
    ASSERT_EQ(t.nbytes, u->nbytes) << t.name;
    EXPECT_EQ(std::memcmp(t.data, u->data, t.nbytes), 0) << t.name;
  }
  o.lr = -1e-3;
  EXPECT_THROW(Trainer{o}, std::invalid_argument);
  fs::remove_all(dir);
}

// bf16 and fp16 (with loss scaling) follow fp32's loss curve step by step.
TEST(Trainer, LowPrecisionTracksFp32) {
  const fs::path dir = make_temp_dir();
  write_hf_config(tiny_byte_llama(), dir / "config.json");
  std::vector<std::vector<double>> losses;
  for (const char* dt : {"fp32", "bf16", "fp16"}) {
    TrainOptions o;
    o.model = dir.string();
    o.dtype = dt;
    o.batch = 2, o.seq = 32, o.steps = 8, o.warmup = 2, o.lr = 3e-3;
    Trainer t(o);
    losses.emplace_back();
    for (int i = 0; i < o.steps; ++i) {
      const StepStats st = t.step();
      EXPECT_FALSE(st.skipped) << dt;
      losses.back().push_back(st.loss);
    }
  }
  EXPECT_LT(losses[0].back(), losses[0].front() - 0.5);  // it learns
  for (size_t k = 1; k < 3; ++k)
    for (size_t i = 0; i < losses[0].size(); ++i)
      EXPECT_NEAR(losses[k][i], losses[0][i], 0.02 * losses[0][i]) << (k == 1 ? "bf16" : "fp16") << " step " << i;
  fs::remove_all(dir);
}

// DESIGN.md: with gradient accumulation the gradient is the mean over the micro-batches, and
// micro-batch k reads the rows at k·B·T, so grad_accum 2 with batch B sees the rows of one
// batch of 2B and must give the same loss, grad norm (before clipping) and weights, up to the
// reduction order of the sums. (Scaling by 1/accum twice halves the grad norm here.)
TEST(Trainer, GradAccumMatchesTheDoubleBatch) {
  const fs::path dir = make_temp_dir();
  write_hf_config(tiny_byte_llama(), dir / "config.json");
  struct Run {
    std::vector<StepStats> steps;
    std::unique_ptr<HfCheckpoint> weights;
  };
  auto train = [&](int64_t batch, int64_t accum, const char* out) {
    TrainOptions o;
    o.model = dir.string();
    o.batch = batch, o.grad_accum = accum, o.seq = 16, o.steps = 4, o.warmup = 1, o.lr = 3e-3;
    o.grad_clip = 0.5;  // clipping active on some steps: the clip factor uses the same norm
    o.threads = 1;
    Trainer t(o);
    Run r;
    for (int i = 0; i < o.steps; ++i) r.steps.push_back(t.step());
    t.save((dir / out).string());
    r.weights = HfCheckpoint::open(dir / out);
    return r;
  };
  const Run acc = train(2, 2, "accum"), big = train(4, 1, "big");
  for (size_t i = 0; i < acc.steps.size(); ++i) {
    EXPECT_NEAR(acc.steps[i].loss, big.steps[i].loss, 1e-6 * big.steps[i].loss) << "step " << i;
    EXPECT_NEAR(acc.steps[i].grad_norm, big.steps[i].grad_norm, 1e-5 * big.steps[i].grad_norm) << "step " << i;
    EXPECT_EQ(acc.steps[i].tokens, big.steps[i].tokens);
  }
  double max_rel = 0;
  for (const StoredTensor& t : big.weights->tensors()) {
    const StoredTensor* u = acc.weights->find(t.name);
    ASSERT_NE(u, nullptr) << t.name;
    const size_t n = t.nbytes / 4;
    std::vector<float> a(n), b(n);
    big.weights->read_into(t.name, t.shape, a.data(), DType::f32);
    acc.weights->read_into(t.name, t.shape, b.data(), DType::f32);
    double diff2 = 0, norm2 = 0;
    for (size_t i = 0; i < n; ++i) {
      diff2 += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
      norm2 += static_cast<double>(a[i]) * a[i];
    }
    max_rel = std::max(max_rel, std::sqrt(diff2 / std::max(norm2, 1e-30)));
  }
  // The weights: AdamW normalises the gradient's scale away (m/sqrt(v)), so this catches a wrong
  // mean only through eps and the clip; the grad norm above is the sharp check. The matmuls
  // over B and 2B rows sum in different orders, hence a tolerance rather than bitwise.
  EXPECT_LT(max_rel, 1e-5);
  fs::remove_all(dir);
}

// A run that diverges stops without applying the step: --lr 1e3 on a tiny model reaches a
// non-finite loss or grad norm within a few steps; that step reports diverged and leaves the
// weights exactly as the step before left them. Non-finite weights are never saved.
TEST(Trainer, DivergedStepAppliesNothing) {
  const fs::path dir = make_temp_dir();
  write_hf_config(tiny_byte_llama(), dir / "config.json");
  TrainOptions o;
  o.model = dir.string();
  o.batch = 1, o.seq = 8, o.steps = 40, o.warmup = 0, o.lr = 1e3;  // decay 0.1: p *= 1 - 100 per step
  Trainer t(o);
  auto saved = [&](const char* name) {
    std::ifstream f(dir / name / "model.safetensors", std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  };
  int diverged_at = -1;
  for (int i = 0; i < o.steps && diverged_at < 0; ++i) {
    bool before_ok = true;
    try {
      t.save((dir / "before").string());
    } catch (const std::runtime_error& e) {  // the previous update overflowed the weights
      before_ok = false;
      EXPECT_NE(std::string(e.what()).find("not finite"), std::string::npos) << e.what();
    }
    const StepStats st = t.step();
    if (!st.diverged) {
      EXPECT_TRUE(std::isfinite(st.loss) && std::isfinite(st.grad_norm)) << "step " << i;
      continue;
    }
    diverged_at = i;
    EXPECT_FALSE(std::isfinite(st.loss) && std::isfinite(st.grad_norm));
    EXPECT_FALSE(st.skipped);
    if (before_ok) {
      t.save((dir / "after").string());
      EXPECT_EQ(saved("after"), saved("before"));
    } else {
      EXPECT_THROW(t.save((dir / "after").string()), std::runtime_error);
    }
  }
  ASSERT_GE(diverged_at, 0) << "lr 1e3 did not diverge in 40 steps";
  fs::remove_all(dir);
}

// GPT-2 checkpoints from the Hub name tensors without the "transformer." prefix; both load.
TEST(Trainer, LoadsGpt2HubNamesWithoutPrefix) {
  const fs::path dir = make_temp_dir();
  ModelConfig c = preset_model_config("gpt2-124m");
  c.hidden_size = 16, c.n_layers = 1, c.n_heads = 2, c.n_kv_heads = 2, c.head_dim = 8, c.intermediate_size = 64;
  c.vocab_size = 300, c.max_position_embeddings = 32;
  fs::create_directories(dir / "init");
  write_hf_config(c, dir / "init" / "config.json");
  TrainOptions o;
  o.model = (dir / "init").string();
  o.batch = 1, o.seq = 8, o.steps = 1;
  Trainer(o).save((dir / "a").string());  // names with "transformer."
  auto ck = HfCheckpoint::open(dir / "a");
  std::vector<TensorToSave> hub;
  std::vector<std::vector<float>> data;
  for (const StoredTensor& t : ck->tensors()) {
    ASSERT_EQ(t.name.rfind("transformer.", 0), 0u) << t.name;
    data.emplace_back(t.nbytes / 4);
    std::memcpy(data.back().data(), t.data, t.nbytes);
    const float* src = data.back().data();
    const size_t bytes = t.nbytes;
    hub.push_back({t.name.substr(12), t.shape, kernels::DType::f32, [src, bytes](void* d) { std::memcpy(d, src, bytes); }});
  }
  save_hf_model(dir / "hub", c, hub);
  o.model = (dir / "hub").string();
  Trainer(o).save((dir / "b").string());
  auto a = HfCheckpoint::open(dir / "a"), b = HfCheckpoint::open(dir / "b");
  for (const StoredTensor& t : a->tensors()) {
    const StoredTensor* u = b->find(t.name);
    ASSERT_NE(u, nullptr) << t.name;
    ASSERT_EQ(t.nbytes, u->nbytes);
    EXPECT_EQ(std::memcmp(t.data, u->data, t.nbytes), 0) << t.name;
  }
  fs::remove_all(dir);
}

TEST(Trainer, ClearErrorsBeforeTraining) {
  TrainOptions o;
  o.seq = 4096;  // default model: 1024 positions
  try {
    Trainer t(o);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("max_position_embeddings"), std::string::npos) << e.what();
  }
  o.seq = 16;
  o.out = "/proc/strata-no-such/out";
  EXPECT_THROW(Trainer{o}, std::runtime_error);
  o.out = "";
  o.lr_schedule = "linear";
  EXPECT_THROW(Trainer{o}, std::invalid_argument);

  // --out is checked by the save's own rules: a symlink (even to a directory) would be refused
  // by the final rename, so it is refused before training.
  o.lr_schedule = "cosine";
  const fs::path dir = make_temp_dir();
  fs::create_directories(dir / "real");
  fs::create_directory_symlink(dir / "real", dir / "link");
  o.out = (dir / "link").string();
  try {
    Trainer t(o);
    ADD_FAILURE() << "a symlinked --out was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("symlink"), std::string::npos) << e.what();
  }
  o.out = "";

  // A run that fails to start (here: no shard matches --data) keeps an earlier metrics file.
  const fs::path metrics = dir / "run.jsonl";
  std::ofstream(metrics) << "{\"step\":1}\n";
  o.metrics = metrics.string();
  o.data = (dir / "no-such-*.bin").string();
  EXPECT_THROW(Trainer{o}, std::runtime_error);
  std::ifstream in(metrics);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "{\"step\":1}");
  fs::remove_all(dir);
}

}  // namespace

namespace strata {
namespace {

// The plan's compute floor from the probed phases: every micro-batch runs the edges and each
// block's forward and backward, a checkpointed block's forward twice; Σg² runs once per step.
TEST(PerfModel, StepComputeAddsThePhasesOfEveryBlock) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  ModelConfig c = tiny_byte_llama();
  c.n_layers = 4;
  Transformer every2(c, DType::f32, 1, 8, *rt, parse_checkpointing("every:2"));  // blocks 0 and 2
  PhaseTimes t;
  t.block_forward_ms = 1, t.block_backward_ms = 3, t.edge_ms = 10, t.sum_squares_ms = 0.5, t.edge_sum_squares_ms = 2;
  // per micro-batch 10 + 4 × (1 + 3) + 2 × 1 = 28; two of them, then 2 + 4 × 0.5
  EXPECT_DOUBLE_EQ(step_compute_ms(t, every2, 2), 60.0);
  Transformer none(c, DType::f32, 1, 8, *rt);
  EXPECT_DOUBLE_EQ(step_compute_ms(t, none, 1), 10 + 16 + 2 + 2.0);
}

// The FLOPs each phase is counted at, by hand for a tiny llama (hidden 32, 2 heads x 16 = q
// width 32, 1 kv head (kv width 16), mlp 64, vocab 256; B 2, T 8: 16 tokens): the block's
// matmuls are q 32x32, k and v 32x16 each, o 32x32, gate and up 32x64 each, down 64x32 = 9216
// parameters; causal attention 2 x 2 x T x Q per token halved = 2 x 8 x 32 x 16 per matmul pair.
TEST(PerfModel, PhaseFlopsCountEveryMatmulAndCausalAttention) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  ModelConfig c = tiny_byte_llama();
  c.hidden_size = 32, c.n_heads = 2, c.n_kv_heads = 1, c.head_dim = 16, c.intermediate_size = 64, c.n_layers = 2;
  const Transformer m(c, DType::f32, 2, 8, *rt);
  const double tokens = 16, params = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 2 * 32 * 64 + 64 * 32;
  const double attention = 2.0 * 2.0 * 8 * 32 * 16 / 2;
  const PhaseFlops f = phase_flops(m);
  EXPECT_DOUBLE_EQ(f.block_forward, 2 * params * tokens + attention);
  EXPECT_DOUBLE_EQ(f.block_backward, 4 * params * tokens + 2 * attention);
  EXPECT_DOUBLE_EQ(f.edge, 3 * 2 * tokens * 32 * 256);
  // A modeled GPU's phases are these FLOPs at its rate.
  const PhaseTimes t = model_phases(m, 1e12, 0);
  EXPECT_DOUBLE_EQ(t.block_forward_ms, f.block_forward / 1e9);
  EXPECT_DOUBLE_EQ(t.edge_ms, f.edge / 1e9);
}

// The GPUs a CUDA device's name matches (the driver's names), and one it does not.
TEST(PerfModel, DeviceNamesMatchTheKnownGpus) {
  const std::pair<const char*, const char*> names[] = {{"NVIDIA H200", "h200"},
                                                       {"NVIDIA H100 80GB HBM3", "h100"},
                                                       {"NVIDIA A100-SXM4-80GB", "a100-80g"},
                                                       {"NVIDIA GeForce RTX 4090", "rtx4090"},
                                                       {"NVIDIA L40S", "l40s"}};
  for (const auto& [device, name] : names) {
    const GpuSpec* g = match_gpu(device);
    ASSERT_NE(g, nullptr) << device;
    EXPECT_EQ(g->name, name) << device;
  }
  EXPECT_EQ(match_gpu("NVIDIA Tesla V100-SXM2-16GB"), nullptr);
  EXPECT_EQ(match_gpu(""), nullptr);
}

// A pipeline's compute: (m − 1) × the slowest stage's micro-batch + every stage's one, plus the
// slowest stage's Σ g²; the head (edge) on the last stage.
TEST(PerfModel, PipelineComputeIsTheSlowestStageTimesMPlusTheFill) {
  PhaseTimes t;
  t.block_forward_ms = 1, t.block_backward_ms = 3, t.edge_ms = 10, t.sum_squares_ms = 0.5, t.edge_sum_squares_ms = 2;
  // 6 layers as 4,2: stage 0 16 ms a micro-batch, stage 1 8 + 10 = 18 (the slowest: 2 × 0.5 + 2 of Σ g²).
  EXPECT_DOUBLE_EQ(pipeline_compute_ms(t, Checkpointing{}, {4, 2}, 4), 3 * 18.0 + (16 + 18) + 3.0);
  // Recomputed layers count their forward twice: every layer 5 ms; 3,3 -> 15 and 25.
  EXPECT_DOUBLE_EQ(pipeline_compute_ms(t, Checkpointing{1}, {3, 3}, 1), 15.0 + 25.0 + 1.5 + 2.0);
}

// The balanced split: the slowest stage as fast as it can be, then the most even. Without a head
// it is the even split; a costly head moves layers off the last stage; the default --pp split
// is the FLOP-balanced one (gpt2-124m, whose 50,257-row head weighs 5.4 layers: 9,3, measured
// 1.52x one rank against 1.31x at 6,6), and --pp-layers wins when given.
TEST(PerfModel, BalancedPipelineSplitTakesTheHeadIntoAccount) {
  PhaseTimes t;
  t.block_forward_ms = 1, t.block_backward_ms = 3;
  EXPECT_EQ(balanced_pipeline_layers(t, Checkpointing{}, 12, 2), (std::vector<int64_t>{6, 6}));
  EXPECT_EQ(balanced_pipeline_layers(t, Checkpointing{}, 4, 4), (std::vector<int64_t>{1, 1, 1, 1}));
  const std::vector<int64_t> seven = balanced_pipeline_layers(t, Checkpointing{}, 7, 3);
  EXPECT_EQ(*std::max_element(seven.begin(), seven.end()), 3);
  EXPECT_EQ(seven[0] + seven[1] + seven[2], 7);
  t.edge_ms = 4 * 5.4;  // the head: 5.4 layers
  EXPECT_EQ(balanced_pipeline_layers(t, Checkpointing{}, 12, 2), (std::vector<int64_t>{9, 3}));
  EXPECT_TRUE(balanced_pipeline_layers(t, Checkpointing{}, 3, 4).empty());  // fewer layers than stages
  const ModelConfig gpt2 = preset_model_config("gpt2-124m");
  EXPECT_EQ(pipeline_split(gpt2, 2, 64, {}, {}, 2, ""), (std::vector<int64_t>{9, 3}));
  EXPECT_EQ(pipeline_split(gpt2, 2, 64, {}, {}, 2, "6,6"), (std::vector<int64_t>{6, 6}));
  EXPECT_EQ(pipeline_split(tiny_byte_llama(), 2, 16, {}, {}, 1, ""), (std::vector<int64_t>{tiny_byte_llama().n_layers}));
  EXPECT_THROW(pipeline_split(gpt2, 2, 64, {}, {}, 13, ""), std::invalid_argument);  // 12 layers
  EXPECT_THROW(pipeline_split(gpt2, 2, 64, {}, {}, 2, "6,5"), std::invalid_argument);
}

// The probe runs the model's own phases on a one-block copy, for llama and gpt2 (tied head) in
// every dtype: each time is finite and positive, and the runtime is usable afterwards.
TEST(PerfModel, ProbePhasesTimesEachPhaseOfAOneBlockCopy) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  ModelConfig gpt2 = preset_model_config("gpt2-124m");
  gpt2.hidden_size = 16, gpt2.n_layers = 3, gpt2.n_heads = 2, gpt2.n_kv_heads = 2, gpt2.head_dim = 8;
  gpt2.intermediate_size = 64, gpt2.vocab_size = 300, gpt2.max_position_embeddings = 32;
  for (const ModelConfig& c : {tiny_byte_llama(), gpt2})
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      const PhaseTimes t = probe_phases(c, dt, 2, 16, *rt, 0.01);
      // Timed directly: positive. The backward and the edges are differences of two timings,
      // which on a model this small may round to zero (never below).
      for (double v : {t.block_forward_ms, t.sum_squares_ms, t.edge_sum_squares_ms}) {
        EXPECT_TRUE(std::isfinite(v));
        EXPECT_GT(v, 0.0);
      }
      for (double v : {t.block_backward_ms, t.edge_ms}) {
        EXPECT_TRUE(std::isfinite(v));
        EXPECT_GE(v, 0.0);
      }
    }
  auto s = rt->create_stream();
  s->synchronize();
}

// The probe's shape: a model whose one-block micro-batch fits the budget is probed as it is; an
// 8B llama at 512 tokens (2.3 TFLOP, 1.6 of it the 128256-row head) first loses head rows, and
// the block stays full width; a tiny budget shrinks everything to its floor, every shape a valid
// config. Nothing is timed: these are the FLOP counts alone.
TEST(PerfModel, ProbeShapeScalesTheHeadFirstAndOnlyAboveTheBudget) {
  const ModelConfig small = tiny_byte_llama();
  const ProbeShape exact = choose_probe_shape(small, 2, 16, 500);
  EXPECT_FALSE(exact.scaled());
  EXPECT_EQ(exact.batch, 2);
  EXPECT_EQ(exact.seq, 16);
  EXPECT_EQ(exact.width_div, 1);
  EXPECT_EQ(exact.vocab, small.vocab_size);
  EXPECT_DOUBLE_EQ(exact.gflop, exact.model_gflop);

  const ModelConfig c8 = preset_model_config("llama-8b");
  const ProbeShape big = choose_probe_shape(c8, 1, 512, 500);
  EXPECT_TRUE(big.scaled());
  EXPECT_NEAR(big.model_gflop, 2290, 5);  // 3 × (2 × 218M × 512 + attention) + 3 × 2 × 512 × 4096 × 128256
  EXPECT_LE(big.gflop, 500);
  EXPECT_LT(big.vocab, c8.vocab_size);
  EXPECT_GE(big.vocab, 2048);
  EXPECT_EQ(big.width_div, 1);
  EXPECT_EQ(big.batch, 1);
  EXPECT_FALSE(choose_probe_shape(c8, 1, 512, 1e6).scaled());

  const ProbeShape floor = choose_probe_shape(c8, 4, 1024, 0.001);
  EXPECT_EQ(floor.vocab, 2048);
  EXPECT_EQ(floor.batch, 1);
  EXPECT_EQ(floor.seq, 128);
  EXPECT_EQ(floor.width_div, 8);  // 8 kv heads: 1 each after, 512 wide
  EXPECT_GT(floor.gflop, 0.001);  // nothing more to shrink
}

// A scaled probe of a small llama and gpt2 (tied head) in bf16: narrower, fewer rows, a smaller
// vocab, each phase extrapolated back: finite and positive, and within a loose factor of the
// exact probe's (timings, so only a bound no machine's noise reaches).
TEST(PerfModel, ScaledProbeExtrapolatesToTheExactProbesTimes) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  ModelConfig llama = tiny_byte_llama();
  llama.hidden_size = 512, llama.n_heads = 8, llama.n_kv_heads = 4, llama.head_dim = 64, llama.intermediate_size = 1024;
  llama.vocab_size = 8192;
  ModelConfig gpt2 = preset_model_config("gpt2-124m");
  gpt2.hidden_size = 512, gpt2.n_layers = 2, gpt2.n_heads = 8, gpt2.n_kv_heads = 8, gpt2.head_dim = 64;
  gpt2.intermediate_size = 2048, gpt2.vocab_size = 8192, gpt2.max_position_embeddings = 256;
  for (const ModelConfig& c : {llama, gpt2}) {
    const ProbeShape shape = choose_probe_shape(c, 2, 64, 0.001);
    ASSERT_TRUE(shape.scaled());
    EXPECT_EQ(shape.vocab, 2048);
    EXPECT_EQ(shape.batch, 1);
    EXPECT_EQ(shape.width_div, 2);
    const PhaseTimes scaled = probe_phases(c, DType::bf16, 2, 64, *rt, 0.05, {}, &shape);
    const PhaseTimes exact = probe_phases(c, DType::bf16, 2, 64, *rt, 0.05);
    const auto step = [](const PhaseTimes& t) { return t.edge_ms + t.block_forward_ms + t.block_backward_ms; };
    for (double v : {scaled.block_forward_ms, scaled.sum_squares_ms, scaled.edge_sum_squares_ms, step(scaled)}) {
      EXPECT_TRUE(std::isfinite(v));
      EXPECT_GT(v, 0.0);
    }
    EXPECT_GT(step(scaled), step(exact) / 10) << c.model_type;
    EXPECT_LT(step(scaled), step(exact) * 10) << c.model_type;
  }
}

// A GPU that is not here: each phase's FLOPs at the given rate (a block's backward twice its
// forward, half that again for a frozen base's input gradients only), Σg² at the memory rate.
TEST(PerfModel, ModeledPhasesAreTheirFlopsAtTheRate) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  const ModelConfig c = tiny_byte_llama();
  Transformer m(c, DType::bf16, 2, 16, *rt);
  const PhaseTimes a = model_phases(m, 1e9, 1e9), b = model_phases(m, 2e9, 0);
  EXPECT_GT(a.block_forward_ms, 0.0);
  EXPECT_DOUBLE_EQ(a.block_backward_ms, 2 * a.block_forward_ms);
  EXPECT_DOUBLE_EQ(b.block_forward_ms, a.block_forward_ms / 2);
  EXPECT_DOUBLE_EQ(b.edge_ms, a.edge_ms / 2);
  const double block_grads = 4.0 * static_cast<double>(m.units()[static_cast<size_t>(m.block_unit(0))].n_real);
  EXPECT_DOUBLE_EQ(a.sum_squares_ms, block_grads / 1e9 * 1e3);
  EXPECT_EQ(b.sum_squares_ms, 0.0);
  LoraSpec lora;
  lora.rank = 4;
  lora.targets = {"q_proj", "v_proj"};
  Transformer frozen(c, DType::bf16, 2, 16, *rt, {}, kLogitsChunkBytes, 1, lora);
  const PhaseTimes f = model_phases(frozen, 1e9, 1e9);
  EXPECT_LT(f.block_backward_ms, a.block_backward_ms);
  EXPECT_GT(f.block_backward_ms, a.block_forward_ms);  // input gradients, and attention's backward
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// What the step driver asks of its memory, recorded without any (a dry run).
class ReleaseRecorder final : public RunMemory {
 public:
  struct Event {
    Role role;
    int index;
    bool release, discard;
    offload::Mode mode;
  };
  ReleaseRecorder(const Transformer& model, bool aliased) : units_(model, Placement{}), aliased_(aliased) {}
  bool dry() const override { return true; }
  void* acquire(Role r, int index, offload::Mode m, Side) override {
    events.push_back({r, index, false, false, m});
    return nullptr;
  }
  void release(Role r, int index) override { events.push_back({r, index, true, false, offload::Mode::read}); }
  void release_discard(Role r, int index) override { events.push_back({r, index, true, true, offload::Mode::read}); }
  bool master_is_weights() const override { return aliased_; }
  const UnitTable& units() const override { return units_; }
  kernels::Stream& stream(Side) override { throw std::logic_error("dry run"); }
  kernels::Ops& ops(Side) override { throw std::logic_error("dry run"); }
  std::vector<Event> events;

 private:
  UnitTable units_;
  bool aliased_;
};

// Spent state is released with discard: each unit's grads once the update has read them, its
// working weights (when they are not the master) after their last use in the step — never in
// an earlier micro-batch, and nothing reads a discarded block before it is written again, over
// two steps of two micro-batches each, for llama and a tied gpt2.
TEST(StepDriverDiscard, SpentGradsAndWeightsAreDiscardedAndNeverReadBeforeRewritten) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  ModelConfig gpt2 = preset_model_config("gpt2-124m");
  gpt2.hidden_size = 16, gpt2.n_layers = 3, gpt2.n_heads = 2, gpt2.n_kv_heads = 2, gpt2.head_dim = 8;
  gpt2.intermediate_size = 64, gpt2.vocab_size = 300, gpt2.max_position_embeddings = 32;
  for (const ModelConfig& c : {tiny_byte_llama(), gpt2})
    for (bool aliased : {false, true}) {
      Transformer model(c, aliased ? DType::f32 : DType::bf16, 1, 8, *rt, parse_checkpointing("every:2"));
      ReleaseRecorder rec(model, aliased);
      const PendingUpdate update;
      for (int step = 0; step < 2; ++step) {
        StepDriver driver(model, rec);
        for (const MicroBatch& mb : StepProgram(2, Placement{}))
          driver.micro_batch(mb, nullptr, nullptr, 1.f, nullptr, &update, nullptr);
      }
      const int units = static_cast<int>(model.units().size());
      std::map<std::pair<Role, int>, int> discards;
      std::set<std::pair<Role, int>> dead;
      for (const auto& e : rec.events) {
        const auto key = std::make_pair(e.role, e.index);
        if (e.release) {
          if (e.discard) ++discards[key], dead.insert(key);
          continue;
        }
        if (dead.count(key)) {
          EXPECT_TRUE(offload::writes(e.mode)) << "role " << int(e.role) << " unit " << e.index << " read after its discard";
          dead.erase(key);
        }
      }
      for (int u = 0; u < units; ++u) {
        EXPECT_EQ(discards[std::make_pair(Role::grads, u)], 2) << "grads of unit " << u;
        EXPECT_EQ(discards[std::make_pair(Role::params, u)], aliased ? 0 : 2) << "weights of unit " << u;
      }
    }
}

}  // namespace
}  // namespace strata
