// `mpirun -np 2 strata train` end to end (ZeRO stages over the CPU backend and OpenMPI): two
// ranks with --batch B match one rank with --batch 2B (the same rows, llm.c's batching) to fp32
// reduction-order tolerance, every ZeRO stage gives bitwise the same run, a sharded run
// checkpoints and resumes bit for bit, and a failing rank takes the job down with its rank named.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_test_util.h"
#include "src/checkpoint/hf.h"

namespace fs = std::filesystem;
using strata::test::CliResult;
using strata::test::kHaveMpi;
using strata::test::slurp;

namespace {

class ZeroCli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kHaveMpi) GTEST_SKIP() << "strata was built without MPI or mpirun: the multi-rank CLI tests did not run";
    std::string t = (fs::path(::testing::TempDir()) / "strata_zero_XXXXXX").string();
    ASSERT_NE(::mkdtemp(t.data()), nullptr);
    dir_ = t;
    fs::create_directories(dir_ / "tiny");
    // A tiny byte-level gpt2 (tied head, biases, LayerNorm): every kind of unit and range.
    std::ofstream(dir_ / "tiny" / "config.json") << R"({
      "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 256,
      "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, "layer_norm_epsilon": 1e-5})";
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  // `strata ARGS` as an np-rank mpirun job (np 0: plainly, no mpirun). Oversubscribed: the test
  // machine may have fewer cores than ranks.
  CliResult run(int np, const std::string& args, const std::string& env = "", const std::string& tag = "run") {
    const fs::path o = dir_ / (tag + ".stdout"), e = dir_ / (tag + ".stderr");
    const std::string cmd = "timeout 120 " + strata::test::launch_prefix(np, env) + std::string(STRATA_BIN) + " " + args + " >" + o.string() +
                            " 2>" + e.string();
    const int rc = std::system(cmd.c_str());
    return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, slurp(o), slurp(e)};
  }
  std::string tiny(int64_t batch, int64_t steps = 4, const std::string& lr = "1e-2") const {
    return "train --model " + (dir_ / "tiny").string() + " --threads 1 --seq 32 --warmup 1 --steps " +
           std::to_string(steps) + " --lr " + lr + " --batch " + std::to_string(batch) + " ";
  }
  static std::vector<nlohmann::json> metrics(const fs::path& p) { return strata::test::read_metrics(p); }
  // Run `tag`'s every step's loss and grad norm, exactly, and its saved weights, byte for byte.
  struct Outcome {
    std::string metrics, weights;
  };
  // Where run `tag` writes what outcome() reads: --metrics and --out.
  std::string outputs(const std::string& tag) const {
    return " --metrics " + (dir_ / (tag + ".jsonl")).string() + " --out " + (dir_ / tag).string();
  }
  // A fresh swap directory of run `tag`, as the flag.
  std::string swap_for(const std::string& tag) const {
    fs::create_directories(dir_ / (tag + "_swap"));
    return " --nvme-path " + (dir_ / (tag + "_swap")).string();
  }
  // The first run's outcome becomes ref; every later one must equal it bit for bit.
  static void expect_as_first(const std::string& tag, const Outcome& got, Outcome& ref, const std::string& first) {
    if (ref.metrics.empty()) {
      ref = got;
      return;
    }
    EXPECT_EQ(got.metrics, ref.metrics) << tag;
    EXPECT_TRUE(got.weights == ref.weights) << tag << ": the saved weights differ from " << first << "'s";
  }
  Outcome outcome(const std::string& tag) const {
    Outcome o;
    for (auto j : metrics(dir_ / (tag + ".jsonl"))) o.metrics += j["loss"].dump() + " " + j["grad_norm"].dump() + "\n";
    o.weights = slurp(dir_ / tag / "model.safetensors");
    return o;
  }
  // Every saved tensor of a model directory, by name, as fp32.
  static std::map<std::string, std::vector<float>> weights(const fs::path& dir) {
    return strata::test::tensors_of(*strata::HfCheckpoint::open(dir));
  }
  fs::path dir_;
};

double rel(double a, double b) { return std::abs(a - b) / std::max({std::abs(a), std::abs(b), 1e-30}); }

// DESIGN.md "Distributed runs (N ranks) match the 1-rank run to floating point reduction-order
// tolerance": 2 ranks x batch 2 read exactly the rows of 1 rank x batch 4.
TEST_F(ZeroCli, TwoRanksMatchOneRankWithTheDoubleBatch) {
  // lr 1e-3: AdamW's m/sqrt(v) turns a reduction-order difference of a tiny gradient into up to
  // ~lr of weight difference; at 1e-3 four steps stay well within 1e-5.
  CliResult one = run(0, tiny(4, 4, "1e-3") + "--metrics " + (dir_ / "one.jsonl").string() + " --out " + (dir_ / "one").string(),
                      "", "one");
  ASSERT_EQ(one.status, 0) << one.err;
  CliResult two = run(2, tiny(2, 4, "1e-3") + "--metrics " + (dir_ / "two.jsonl").string() + " --out " + (dir_ / "two").string(),
                      "", "two");
  ASSERT_EQ(two.status, 0) << two.out << two.err;
  EXPECT_NE(two.out.find("ranks      2"), std::string::npos) << two.out;
  // Rank 0 alone prints: one header.
  EXPECT_EQ(two.out.find("strata train"), two.out.rfind("strata train")) << two.out;
  const auto a = metrics(dir_ / "one.jsonl"), b = metrics(dir_ / "two.jsonl");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LT(rel(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()), 1e-5) << "step " << i + 1;
    EXPECT_LT(rel(a[i]["grad_norm"].get<double>(), b[i]["grad_norm"].get<double>()), 1e-5) << "step " << i + 1;
    EXPECT_EQ(a[i]["tokens"], b[i]["tokens"]);
    // Communication time is measured: none on one rank; on two, compute waits for some of the
    // collectives (on their own stream): at most all of it is exposed, give or take a thread
    // wake-up per wait (this model is tiny: its step's communication is mostly exposed).
    EXPECT_EQ(a[i]["comm_ms"].get<double>(), 0.0);
    EXPECT_GT(b[i]["comm_ms"].get<double>(), 0.0) << "step " << i + 1;
    EXPECT_LE(b[i]["comm_exposed_ms"].get<double>(), 1.1 * b[i]["comm_ms"].get<double>() + 2) << "step " << i + 1;
    EXPECT_GT(b[i]["comm_exposed_ms"].get<double>(), 0.0) << "step " << i + 1;
    EXPECT_LE(b[i]["comm_ms"].get<double>(), b[i]["step_ms"].get<double>()) << "step " << i + 1;
  }
  const auto wa = weights(dir_ / "one"), wb = weights(dir_ / "two");
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, va] : wa) {
    const auto& vb = wb.at(name);
    ASSERT_EQ(va.size(), vb.size()) << name;
    double worst = 0;
    for (size_t i = 0; i < va.size(); ++i) worst = std::max(worst, std::abs(double(va[i]) - vb[i]));
    EXPECT_LT(worst, 1e-5) << name;
  }
}

// Every ZeRO stage runs the same sums in the same order: bitwise the same losses, norms and
// weights at the same world size, whether the optimizer state, grads and working weights are in
// RAM or on NVMe (stage 3: the weights' shards on NVMe, gathered per unit). With gradient
// accumulation stages 2 and 3 reduce-scatter every micro-batch and add the shards (as DeepSpeed
// does) where stages 0 and 1 add the whole grads locally and sum once: the same math in another
// order, so there they match to fp32 tolerance, not bitwise.
TEST_F(ZeroCli, StagesAreBitwiseIdentical) {
  for (int accum : {1, 2}) {
    std::vector<double> ref_values;
    std::string ref_metrics, ref_weights;
    for (const std::string offload : {"", "nvme"})
      for (int stage : {0, 1, 2, 3}) {
        std::string tag = std::to_string(stage);  // (not "s" + ...: GCC 12's -Wrestrict false positive)
        tag.insert(tag.begin(), 's');
        tag += offload;
        tag += "a";
        tag += std::to_string(accum);
        std::string args =
            tiny(2) + "--grad-accum " + std::to_string(accum) + " --zero-stage " + std::to_string(stage) + outputs(tag);
        if (!offload.empty())
          args += " --offload-optimizer nvme --offload-grads nvme --offload-params nvme" + swap_for(tag);
        CliResult r = run(2, args, "", tag);
        ASSERT_EQ(r.status, 0) << tag << ": " << r.out << r.err;
        std::string m;
        std::vector<double> values;
        for (auto j : metrics(dir_ / (tag + ".jsonl"))) {
          m += j["loss"].dump() + " " + j["grad_norm"].dump() + "\n";
          values.push_back(j["loss"].get<double>());
          values.push_back(j["grad_norm"].get<double>());
        }
        const std::string w = slurp(dir_ / tag / "model.safetensors");
        if (ref_metrics.empty()) {
          ref_metrics = m;
          ref_weights = w;
          ref_values = values;
          continue;
        }
        if (stage >= 2 && accum > 1) {
          ASSERT_EQ(values.size(), ref_values.size());
          for (size_t i = 0; i < values.size(); ++i) EXPECT_LT(rel(values[i], ref_values[i]), 1e-5) << tag << " " << i;
          continue;
        }
        EXPECT_EQ(m, ref_metrics) << tag;
        EXPECT_TRUE(w == ref_weights) << tag << ": the saved weights differ from stage 0's";
      }
  }
}

// Collectives run on a stream of their own, ordered against compute by events only (StepDriver:
// prefetched gathers into slots that take turns, reduce-scatters from scratch slots that take
// turns). Random delays before every task of every stream (STRATA_TEST_STREAM_JITTER_US) shake
// the interleavings: a missing event would let a gather overwrite a slot still being read, or
// a backward overwrite a scratch slot still being reduced, and change the numbers. Each stage
// (with accumulation, offload for stage 3) must give bitwise the run without delays.
TEST_F(ZeroCli, CollectivesOverlapComputeUnderRandomStreamSchedules) {
  for (const std::string variant : {"1", "2", "3", "3nvme"}) {
    Outcome ref;
    for (const bool jitter : {false, true}) {
      const std::string stage = variant.substr(0, 1);
      const std::string tag = "j" + variant + (jitter ? "y" : "n");
      std::string args = tiny(2) + "--grad-accum 2 --zero-stage " + stage + outputs(tag);
      if (variant == "3nvme") args += " --offload-optimizer nvme --offload-grads cpu --offload-params nvme" + swap_for(tag);
      CliResult r = run(2, args, jitter ? "STRATA_TEST_STREAM_JITTER_US=300" : "", tag);
      ASSERT_EQ(r.status, 0) << tag << ": " << r.out << r.err;
      const Outcome got = outcome(tag);
      if (!jitter) {
        ref = got;
        continue;
      }
      EXPECT_EQ(got.metrics, ref.metrics) << tag;
      EXPECT_TRUE(got.weights == ref.weights) << tag << ": the saved weights differ from the run without delays";
    }
  }
}

// Without clipping, stages 0-1 update each unit in the backward once its gradient is summed
// across ranks (stage 1 all-gathers the new shards there too); stages 2-3 keep the update in the
// next forward. Every variant, with random stream delays and with state on NVMe, must give
// bitwise stage 2's run.
TEST_F(ZeroCli, UpdateInTheBackwardIsBitwiseAcrossStages) {
  Outcome ref;
  for (const std::string variant : {"2", "0", "1", "0j", "1j", "1nvme"}) {
    const std::string stage = variant.substr(0, 1);
    const std::string tag = "ub" + variant;
    std::string args = tiny(2) + "--grad-clip 0 --zero-stage " + stage + outputs(tag);
    if (variant == "1nvme") args += " --offload-optimizer nvme --offload-grads nvme --offload-params nvme" + swap_for(tag);
    const bool jitter = variant.size() > 1;
    CliResult r = run(2, args, jitter ? "STRATA_TEST_STREAM_JITTER_US=300" : "", tag);
    ASSERT_EQ(r.status, 0) << tag << ": " << r.out << r.err;
    EXPECT_EQ(r.out.find("updates in the backward") != std::string::npos, stage != "2") << tag << ": " << r.out;
    expect_as_first(tag, outcome(tag), ref, "stage 2");
  }
}

// --speculate on 2 ranks: the update in the backward as if nothing clips, redone where the norm
// says otherwise, is bitwise stage 2's run (which waits for the norm) at stages 0 and 1, with the
// optimizer on NVMe and under random stream delays; with a clip between the observed norms some
// steps roll back and some do not (and auto, on NVMe, switches to waiting for the norm after a
// rollback and back; with its trial, rank 0's verdict holds for both ranks).
TEST_F(ZeroCli, SpeculationIsBitwiseAcrossStages) {
  ASSERT_EQ(run(2, tiny(2, 6) + "--grad-clip 1e9 --zero-stage 0" + outputs("specprobe"), "", "specprobe").status, 0);
  std::vector<double> norms;
  for (const auto& j : metrics(dir_ / "specprobe.jsonl")) norms.push_back(j["grad_norm"].get<double>());
  ASSERT_EQ(norms.size(), 6u);
  std::sort(norms.begin(), norms.end());
  char clip[32];
  std::snprintf(clip, sizeof(clip), "%.17g", (norms[2] + norms[3]) / 2);
  Outcome ref;
  for (const std::string variant : {"2", "0", "1", "1j", "1nvme", "1trial"}) {
    const std::string stage = variant.substr(0, 1);
    const std::string tag = "spec" + variant;
    std::string args = tiny(2, 6) + "--grad-clip " + std::string(clip) + " --zero-stage " + stage + outputs(tag);
    // auto speculates there (1nvme without its trial: from the start, backing off after rollbacks;
    // 1trial: steps 1-2 speculate, 3-4 wait, then each rank's own verdict differs (trial-verdicts:10)
    // and rank 0's, speculate, must hold on both)
    args += variant == "1nvme"    ? " --speculate auto --speculate-trial 0 --offload-optimizer nvme" + swap_for(tag)
            : variant == "1trial" ? " --speculate auto --speculate-trial 2 --offload-optimizer nvme" + swap_for(tag)
                                  : std::string(" --speculate ") + (stage == "2" ? "auto" : "on");
    const std::string env = variant == "1j" ? "STRATA_TEST_STREAM_JITTER_US=300"
                            : variant == "1trial" ? "STRATA_FAULT=trial-verdicts:10"
                                                  : "";
    CliResult r = run(2, args, env, tag);
    ASSERT_EQ(r.status, 0) << tag << ": " << r.out << r.err;
    int rolled = 0, speculated = 0;
    for (const auto& j : metrics(dir_ / (tag + ".jsonl"))) {
      speculated += j["speculated"].get<bool>();
      rolled += j["rolled_back"].get<bool>();
    }
    if (stage == "2") {
      EXPECT_EQ(speculated, 0) << tag;
    } else if (variant == "1trial") {
      std::vector<bool> each;
      for (const auto& j : metrics(dir_ / (tag + ".jsonl"))) each.push_back(j["speculated"].get<bool>());
      const std::vector<bool> want = {true, true, false, false, true, true};
      EXPECT_EQ(each, want) << tag;
      EXPECT_NE(r.out.find("speculates from now on"), std::string::npos) << tag << ": " << r.out;
    } else if (variant == "1nvme") {  // auto: waits for the norm for a while after a rollback
      EXPECT_LT(speculated, 6) << tag;
      EXPECT_GT(rolled, 0) << tag;
      EXPECT_LT(rolled, speculated) << tag;
    } else {
      EXPECT_EQ(speculated, 6) << tag;
      EXPECT_EQ(rolled, 3) << tag << ": the steps above the median norm";
    }
    expect_as_first(tag, outcome(tag), ref, "stage 2");
  }
}

// Twin-Flow across ranks (--optimizer-on-device): each rank keeps the first units' shards of the
// master and AdamW state on the device and updates them there, the rest on the CPU's side, on a
// runtime and stream of its own (STRATA_FAULT=separate-optimizer, as on a GPU): bitwise the stage
// 0 run at every stage, the rest in RAM or on NVMe, under random stream delays too (an update's
// all-gather waits for the side that wrote the shard).
TEST_F(ZeroCli, TwinFlowIsBitwiseAcrossStages) {
  Outcome ref;
  for (const std::string variant : {"0", "1", "1nvme", "2", "3", "3nvme", "1j"}) {
    const std::string stage = variant.substr(0, 1);
    const std::string tag = "twin" + variant;
    std::string args = tiny(2) + "--zero-stage " + stage + outputs(tag);
    if (variant != "0")
      args += variant.ends_with("nvme") ? " --optimizer-on-device 0.5 --offload-optimizer nvme" + swap_for(tag)
                                        : std::string(" --optimizer-on-device 0.5 --offload-optimizer cpu");
    const std::string env = std::string("STRATA_FAULT=separate-optimizer") +
                            (variant == "1j" ? " STRATA_TEST_STREAM_JITTER_US=300" : "");
    CliResult r = run(2, args, env, tag);
    ASSERT_EQ(r.status, 0) << tag << ": " << r.out << r.err;
    if (variant != "0") {
      EXPECT_NE(r.out.find("twin-flow  --optimizer-on-device 0.5"), std::string::npos) << tag << ": " << r.out;
    }
    expect_as_first(tag, outcome(tag), ref, "stage 0 with the optimizer on the device");
  }
}

// Collectives staged through host memory on worker streams, as a GPU's device buffers are when
// ranks share a GPU (the mpi communicator on --backend cuda; STRATA_TEST_STAGED_COMM stages the
// CPU backend's streams the same way): every ZeRO stage, the pipeline's point-to-point
// transfers and tensor parallelism's collectives on the compute stream give bitwise the
// unstaged runs, under random stream delays too.
TEST_F(ZeroCli, StagedCollectivesAreBitwiseTheDirectOnes) {
  for (const std::string grid : {"3", "0", "pp", "tp"}) {
    Outcome ref;
    for (const bool stage : {false, true}) {
      const std::string tag = "staged_" + grid + (stage ? "_on" : "_off");
      std::string args = tiny(2, 3) + outputs(tag) + " --grad-accum 2";
      args += grid == "pp" ? " --pp 2" : grid == "tp" ? " --tp 2" : " --zero-stage " + grid;
      const std::string env = stage ? "STRATA_TEST_STAGED_COMM=1 STRATA_TEST_STREAM_JITTER_US=200" : "";
      CliResult r = run(2, args, env, tag);
      ASSERT_EQ(r.status, 0) << tag << ": " << r.out << r.err;
      expect_as_first(tag, outcome(tag), ref, "the direct run");
    }
  }
}

// LoRA across ranks: the frozen base replicated (stages 0-2) or sharded and gathered per layer
// beside the layer's adapters (3), the adapters' grads all-reduced (stages 0-1) or
// reduce-scattered (2-3), their AdamW state sharded (1-3): bitwise the same run at every stage,
// with the optimizer and base on NVMe too and, at stage 3, under random stream delays (a gather
// into an adapter slot still being read would change the numbers); a saved adapter byte for byte.
TEST_F(ZeroCli, LoraStagesAreBitwise) {
  Outcome ref;
  for (const std::string variant : {"0", "1", "2", "2nvme", "3", "3nvme", "3j"}) {
    const std::string tag = "lora" + variant;
    std::string args = tiny(2) + "--lora-rank 4 --lora-targets all-linear --zero-stage " + variant.substr(0, 1) +
                       outputs(tag);
    if (variant.ends_with("nvme")) args += " --offload-optimizer nvme --offload-params nvme" + swap_for(tag);
    CliResult r = run(2, args, variant == "3j" ? "STRATA_TEST_STREAM_JITTER_US=300" : "", tag);
    ASSERT_EQ(r.status, 0) << tag << ": " << r.out << r.err;
    Outcome got;
    for (auto j : metrics(dir_ / (tag + ".jsonl"))) got.metrics += j["loss"].dump() + " " + j["grad_norm"].dump() + "\n";
    got.weights = slurp(dir_ / tag / "adapter_model.safetensors");
    ASSERT_FALSE(got.weights.empty()) << tag;
    expect_as_first(tag, got, ref, "stage 0");
  }
}

// An untied head shares the whole-unit buffer of the embedding (gathered at stage 3 once the
// embedding's forward is done with it; its grads reduce-scattered before the embedding's
// backward writes there): a tiny llama, bitwise stage 0's run at stages 2 and 3, and under
// random stream delays (a gather or backward into the slot too early would change the numbers).
TEST_F(ZeroCli, UntiedHeadSharesTheEmbeddingsSlot) {
  fs::create_directories(dir_ / "llama");
  std::ofstream(dir_ / "llama" / "config.json") << R"({
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})";
  Outcome ref;
  for (const std::string variant : {"0", "2", "3", "3j"}) {
    const std::string tag = "untied" + variant;
    const std::string args = "train --model " + (dir_ / "llama").string() +
                             " --threads 1 --seq 32 --warmup 1 --steps 3 --lr 1e-2 --batch 2 --zero-stage " +
                             variant.substr(0, 1) + outputs(tag);
    CliResult r = run(2, args, variant == "3j" ? "STRATA_TEST_STREAM_JITTER_US=300" : "", tag);
    ASSERT_EQ(r.status, 0) << tag << ": " << r.out << r.err;
    expect_as_first(tag, outcome(tag), ref, "stage 0");
  }
}

// The same with bf16 working weights (2-byte shards and gathers, padding in bf16): stage 3's
// gathered weights are stage 0's, bit for bit.
TEST_F(ZeroCli, StageThreeIsBitwiseStageZeroInBf16) {
  Outcome ref;
  for (const std::string stage : {"0", "3"}) {
    const std::string tag = "bf" + stage;
    CliResult r = run(2, tiny(2) + "--dtype bf16 --zero-stage " + stage + outputs(tag), "", tag);
    ASSERT_EQ(r.status, 0) << tag << ": " << r.out << r.err;
    expect_as_first(tag, outcome(tag), ref, "stage 0");
  }
}

// A sharded run's checkpoint (gathered to rank 0, unsharded by name) resumes bit for bit, with
// the grads (stage 2) and the working weights too (stage 3) sharded.
TEST_F(ZeroCli, ShardedCheckpointResumesBitExact) {
  for (const std::string stage : {"2", "3"}) {
    const fs::path ck = dir_ / ("ck" + stage), full = dir_ / ("full" + stage), resumed = dir_ / ("resumed" + stage);
    CliResult a = run(2, tiny(2) + "--zero-stage " + stage + " --checkpoint-every 2 --checkpoint-dir " + ck.string() +
                             " --out " + full.string(),
                      "", "full" + stage);
    ASSERT_EQ(a.status, 0) << stage << ": " << a.err;
    ASSERT_TRUE(fs::exists(ck / "step-00000002")) << a.out;
    CliResult b = run(2, tiny(2) + "--zero-stage " + stage + " --resume " + (ck / "step-00000002").string() +
                             " --out " + resumed.string(),
                      "", "rest" + stage);
    ASSERT_EQ(b.status, 0) << stage << ": " << b.err;
    EXPECT_NE(b.out.find("resumed"), std::string::npos) << b.out;
    EXPECT_TRUE(slurp(full / "model.safetensors") == slurp(resumed / "model.safetensors")) << "stage " << stage;
  }
}

// A sharded checkpoint reaches rank 0 a piece at a time (TensorStream: kSavePieceBytes of one
// tensor, gathered from the shards that hold it straight into the writer's buffer): writing one
// raises rank 0's peak RSS by about one piece (64 MiB), not by the largest unit's m and v (the
// tied embedding: 2 x 147 MiB, when it went a unit at a time) nor by the whole model's master, m
// and v (12 bytes a parameter: +1.46 GiB on gpt2-124m when they were gathered whole).
// --metrics' peak_rss_bytes is rank 0's, and the checkpoint of step 2 is written before step 2's
// line: step 2 against step 1.
TEST_F(ZeroCli, ShardedCheckpointStagesAPieceAtATimeOnRankZero) {
  const fs::path ck = dir_ / "ck", m = dir_ / "m.jsonl";
  CliResult r = run(2,
                    "train --preset gpt2-124m --threads 1 --seq 16 --batch 1 --steps 3 --zero-stage 3 "
                    "--checkpoint-every 2 --checkpoint-dir " + ck.string() + " --metrics " + m.string(),
                    "", "big");
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_TRUE(fs::exists(ck / "step-00000002")) << r.out;
  const auto j = metrics(m);
  ASSERT_EQ(j.size(), 3u);
  const double before = j[0]["peak_rss_bytes"].get<double>(), after = j[1]["peak_rss_bytes"].get<double>();
  EXPECT_GT(before, 1e9);  // (the pools: 2 GB at stage 3 on 2 ranks)
  EXPECT_LT(after - before, 160.0 * (1 << 20)) << "the checkpoint raised rank 0's peak RSS from " << before / (1 << 20)
                                               << " to " << after / (1 << 20) << " MiB";
}

// Rank 0 failing in the middle of a sharded checkpoint (STRATA_FAULT=save-fill: the tiny model's
// checkpoint is 84 tensor fills, 28 masters then 56 moments; fill 100 is the second one's 16th
// master) takes the job down with that error: the other rank, gathering for it, is not left
// hanging, and the checkpoint before stays `latest` and resumes.
TEST_F(ZeroCli, AFailedShardedCheckpointKeepsThePreviousOne) {
  const fs::path ck = dir_ / "ck";
  const std::string args = tiny(2, 4) + "--zero-stage 3 --checkpoint-every 2 --checkpoint-dir " + ck.string();
  CliResult r = run(2, args, "STRATA_FAULT=save-fill:100", "fail");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.status, 124) << "timed out: a rank hung";
  EXPECT_NE(r.err.find("save-fill:100"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::exists(ck / "step-00000002" / "trainer.json"));
  EXPECT_FALSE(fs::exists(ck / "step-00000004"));
  EXPECT_NE(slurp(ck / "latest").find("step-00000002"), std::string::npos);
  CliResult again = run(2, args + " --resume auto", "", "again");
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_NE(again.out.find("resumed"), std::string::npos) << again.out;
}

// What each rank holds (strata plan --world N): stage 3 shards the working weights, so a rank's
// weight bytes are 1/N of stage 2's (the units are padded to N x 2048 elements, so exactly);
// what it sends per step grows from ~2 to ~3 units' worth (ZeRO: 2Ψ -> 3Ψ), the blocks
// gathered twice (forward, backward).
TEST_F(ZeroCli, StageThreeHoldsAShardOfTheWeights) {
  auto plan = [&](int world, int stage) {
    CliResult r = run(0, "plan --model " + (dir_ / "tiny").string() + " --seq 32 --batch 2 --probe-seconds 0.01 --json" +
                             " --world " + std::to_string(world) + " --zero-stage " + std::to_string(stage),
                      "", "plan" + std::to_string(world) + std::to_string(stage));
    EXPECT_EQ(r.status, 0) << r.err;
    return nlohmann::json::parse(r.out);
  };
  const auto s2 = plan(2, 2), s3 = plan(2, 3), w4 = plan(4, 3);
  const auto w2 = s2["params_bytes"].get<uint64_t>();
  EXPECT_EQ(s3["params_bytes"].get<uint64_t>() * 2, w2);
  // 4 ranks: about half again (units padded to 4 x 2048 elements, so not exactly).
  const double q = 2.0 * w4["params_bytes"].get<double>() / s3["params_bytes"].get<double>();
  EXPECT_GT(q, 0.9);
  EXPECT_LT(q, 1.15);
  // fp32: the weights shard is the master shard, one block (no second copy of the shard).
  EXPECT_EQ(s3["master_bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(s3["params_bytes"], s2["master_bytes"]);
  EXPECT_EQ(s3["grads_bytes"], s2["grads_bytes"]);
  // The gathered-unit buffers (three slots, whole units) are charged to the device budget.
  EXPECT_GT(s3["buffers_bytes"].get<uint64_t>(), s2["buffers_bytes"].get<uint64_t>());
  // Sent per rank: stage 2 = weights (fp32 here) + grads = 2 x (N-1)/N x Ψ x 4 bytes; stage 3
  // gathers the weights in forward and again in backward (not after the update): ~3 x.
  const double c2 = s2["comm_bytes_sent_per_rank"].get<double>(), c3 = s3["comm_bytes_sent_per_rank"].get<double>();
  EXPECT_GT(c3 / c2, 1.3);
  EXPECT_LT(c3 / c2, 1.6);
}

// A checkpoint is stored unsharded by tensor name, so it resumes at another world size: 2 ranks
// (stage 1) saved at step 2, resumed by 1 rank with the double batch (and the other way round,
// into stage 2), continue the same run to fp32 reduction-order tolerance.
TEST_F(ZeroCli, CheckpointResumesAtAnotherWorldSize) {
  const std::string ck2 = (dir_ / "ck2").string(), ck1 = (dir_ / "ck1").string();
  CliResult two = run(2, tiny(2, 4, "1e-3") + "--zero-stage 1 --checkpoint-every 2 --checkpoint-dir " + ck2 +
                             " --metrics " + (dir_ / "two.jsonl").string() + " --out " + (dir_ / "two").string(),
                      "", "two");
  ASSERT_EQ(two.status, 0) << two.err;
  CliResult one = run(0, tiny(4, 4, "1e-3") + "--checkpoint-every 2 --checkpoint-dir " + ck1 + " --metrics " +
                             (dir_ / "one.jsonl").string() + " --out " + (dir_ / "one").string(),
                      "", "one");
  ASSERT_EQ(one.status, 0) << one.err;
  // 2 ranks -> 1 rank, and 1 rank -> 2 ranks (stage 2).
  CliResult a = run(0, tiny(4, 4, "1e-3") + "--resume " + ck2 + "/step-00000002 --metrics " +
                           (dir_ / "a.jsonl").string() + " --out " + (dir_ / "a").string(),
                    "", "a");
  ASSERT_EQ(a.status, 0) << a.err;
  CliResult b = run(2, tiny(2, 4, "1e-3") + "--zero-stage 2 --resume " + ck1 + "/step-00000002 --metrics " +
                           (dir_ / "b.jsonl").string() + " --out " + (dir_ / "b").string(),
                    "", "b");
  ASSERT_EQ(b.status, 0) << b.err;
  for (const auto& [ref, got, out] : {std::tuple{"two.jsonl", "a.jsonl", "a"}, std::tuple{"one.jsonl", "b.jsonl", "b"}}) {
    const auto r = metrics(dir_ / ref), g = metrics(dir_ / got);
    ASSERT_EQ(r.size(), 4u);
    ASSERT_EQ(g.size(), 2u) << got;
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(g[i]["step"], r[i + 2]["step"]);
      EXPECT_LT(rel(r[i + 2]["loss"].get<double>(), g[i]["loss"].get<double>()), 1e-5) << got << " step " << i + 3;
      EXPECT_LT(rel(r[i + 2]["grad_norm"].get<double>(), g[i]["grad_norm"].get<double>()), 1e-5) << got;
    }
    const auto wr = weights(dir_ / (std::string(ref) == "two.jsonl" ? "two" : "one")), wg = weights(dir_ / out);
    for (const auto& [name, vr] : wr) {
      const auto& vg = wg.at(name);
      double worst = 0;
      for (size_t i = 0; i < vr.size(); ++i) worst = std::max(worst, std::abs(double(vr[i]) - vg[i]));
      EXPECT_LT(worst, 1e-5) << out << ": " << name;
    }
  }
}

}  // namespace

namespace {

// A rank that fails takes the job down, quickly, with its rank named: rank 1's --nvme-path is
// not a directory it can use (an MPMD job: each rank its own command line) while rank 0 starts
// training and waits for it in the first collective.
TEST_F(ZeroCli, AFailingRankStopsTheJobNamingIt) {
  fs::create_directories(dir_ / "swap");
  const std::string base = tiny(2, 50) + "--offload-optimizer nvme --nvme-path ";
  const auto t0 = std::chrono::steady_clock::now();
  CliResult r = run(1, base + (dir_ / "swap").string() + " : -np 1 " + STRATA_BIN + " " + base + "/proc/version/nope",
                    "", "fail");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.status, 0) << r.out << r.err;
  EXPECT_LT(s, 30) << "the job took " << s << " s to stop";
  EXPECT_NE(r.err.find("strata: rank 1: error:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("/proc/version/nope"), std::string::npos) << r.err;
}

// A rank killed in the middle of a step (SIGKILL, as a crashed node) stops the job.
TEST_F(ZeroCli, AKilledRankStopsTheJob) {
  const auto t0 = std::chrono::steady_clock::now();
  CliResult r = run(2, tiny(2, 50) + "--zero-stage 1", "STRATA_FAULT=kill:1:3", "kill");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.status, 0) << r.out << r.err;
  EXPECT_LT(s, 30) << "the job took " << s << " s to stop";
  // (Progress lines are not checked: mpirun may drop the last forwarded output of a killed job.)
  EXPECT_EQ(r.out.find("step 3/50"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("done:"), std::string::npos) << r.out;
  EXPECT_NE((r.out + r.err).find("rank 1"), std::string::npos) << r.out << r.err;
}

// Ranks started with different flags (an MPMD job, or a per-node script gone wrong) are refused
// at start-up with the flag and every rank's value, instead of hanging or training something
// else than asked.
TEST_F(ZeroCli, RanksStartedWithDifferentFlagsAreRefused) {
  // (tiny() without the flags the cases set)
  const std::string base = "train --model " + (dir_ / "tiny").string() + " --seq 32 --warmup 1 --lr 1e-2 ";
  fs::create_directories(dir_ / "ck");
  ASSERT_EQ(run(0, tiny(2, 3) + "--checkpoint-dir " + (dir_ / "ck").string(), "", "ck").status, 0);
  struct Case {
    std::string rank0, rank1, says;
  };
  const std::vector<Case> cases = {
      {"--steps 3", "--steps 4", "--steps differs between the ranks of this job (rank 0 has 3, rank 1 has 4)"},
      {"--batch 2", "--batch 4", "--batch differs"},
      {"--seed 1", "--seed 2", "--seed differs"},
      {"", "--out " + (dir_ / "o").string(), "--out differs between the ranks of this job (rank 0 has it unset"},
      {"--zero-stage 0", "--zero-stage 2", "--zero-stage differs"},
      // (the process groups are split after this check: with different --tp they would not line up)
      {"--tp 2", "--tp 1", "--tp differs between the ranks of this job (rank 0 has 2, rank 1 has 1)"},
      {"--steps 5", "--resume " + (dir_ / "ck").string() + " --steps 5", "--resume differs"},
  };
  for (const Case& c : cases) {
    const auto t0 = std::chrono::steady_clock::now();
    const CliResult r =
        run(1, base + c.rank0 + " : -np 1 " + STRATA_BIN + " " + base + c.rank1, "", "differ");
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(r.status, 0) << c.rank1;
    EXPECT_LT(sec, 30) << c.rank1 << ": " << sec << " s";
    EXPECT_NE(r.err.find(c.says), std::string::npos) << c.rank1 << ": " << r.err;
    EXPECT_EQ(r.out.find("step 1/"), std::string::npos) << r.out;
  }
  // --threads and --nvme-path are a rank's own.
  const CliResult ok = run(1, base + "--steps 2 --threads 1 : -np 1 " + STRATA_BIN + " " + base + "--steps 2 --threads 2",
                           "", "ok");
  EXPECT_EQ(ok.status, 0) << ok.err;
}

// Ctrl-C on a job started by scripts/strata-mpirun (SIGINT to its process group, as a terminal
// sends it): every rank stops after the same step, rank 0 writes the checkpoint, the status is
// 130, and the checkpoint resumes bit for bit.
TEST_F(ZeroCli, CtrlCOnTheLauncherKeepsACheckpointThatResumesBitExact) {
  const fs::path ck = dir_ / "ck", out = dir_ / "ctrlc.stdout", err = dir_ / "ctrlc.stderr";
  const std::string launcher = std::string(STRATA_SOURCE_DIR) + "/scripts/strata-mpirun";
  const std::string args = tiny(2, 100000, "1e-3") + "--lr-schedule constant --zero-stage 1 --checkpoint-dir " + ck.string() + " --metrics " +
                           (dir_ / "a.jsonl").string();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::setpgid(0, 0);
    ::setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    ::setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    ::setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    ::setenv("MPIRUN", STRATA_TEST_MPIEXEC, 1);
    const std::string cmd = "exec bash " + launcher + " -np 2 " + STRATA_BIN + " " + args + " >" + out.string() +
                            " 2>" + err.string();
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  while (slurp(out).find(" 3/100000") == std::string::npos && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_NE(slurp(out).find(" 3/100000"), std::string::npos) << slurp(err);
  ::kill(-pid, SIGINT);
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 130) << slurp(out) << slurp(err);
  std::string latest = slurp(ck / "latest");
  ASSERT_FALSE(latest.empty()) << slurp(out) << slurp(err);
  latest.pop_back();
  const int64_t k = std::stoll(latest.substr(5));
  EXPECT_NE(slurp(out).find("stopped by SIGUSR2"), std::string::npos) << slurp(out);
  // The checkpoint continues exactly as an uninterrupted run of k + 3 steps.
  const std::string more = tiny(2, k + 3, "1e-3") + "--lr-schedule constant --zero-stage 1 ";
  ASSERT_EQ(run(2, more + "--metrics " + (dir_ / "ref.jsonl").string(), "", "ref").status, 0);
  ASSERT_EQ(run(2, more + "--checkpoint-dir " + ck.string() + " --resume auto --metrics " + (dir_ / "b.jsonl").string(),
                "", "resume")
                .status,
            0);
  const auto ref = metrics(dir_ / "ref.jsonl"), resumed = metrics(dir_ / "b.jsonl");
  ASSERT_EQ(resumed.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(resumed[i]["loss"].dump(), ref[static_cast<size_t>(k) + i]["loss"].dump()) << i;
    EXPECT_EQ(resumed[i]["grad_norm"].dump(), ref[static_cast<size_t>(k) + i]["grad_norm"].dump()) << i;
  }
}

}  // namespace
