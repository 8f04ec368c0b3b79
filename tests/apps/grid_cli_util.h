// The fixture of the parallel-grid CLI tests (tensor and pipeline parallelism): mpirun jobs of
// the built `strata` in a scratch directory, their metrics and saved weights, and the fp32
// tolerance a grid's run keeps to the 1-rank run with the same global batch.
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_test_util.h"
#include "src/checkpoint/hf.h"

namespace strata::test {

inline double rel(double a, double b) { return std::abs(a - b) / std::max({std::abs(a), std::abs(b), 1e-30}); }

class GridCli : public ::testing::Test {
 protected:
  // A scratch directory named after the suite (nothing else; the suites write their models).
  void make_dir(const std::string& name) {
    if (!kHaveMpi) GTEST_SKIP() << "strata was built without MPI or mpirun: the multi-rank CLI tests did not run";
    dir_ = make_scratch_dir(name);
    ASSERT_FALSE(dir_.empty());
  }
  // Two small models with `layers` layers in dir_/gpt2 and dir_/llama. gpt2: c_attn's q, k and
  // v as three segments, biases on every linear layer, learned positions, a tied head. llama:
  // GQA (4 q heads, 2 kv heads), q/k/v biases (qwen2 style), an untied head, and 259 tokens (a
  // vocabulary 2 or 4 ranks do not divide).
  void write_models(int layers) {
    std::filesystem::create_directories(dir_ / "gpt2");
    std::ofstream(dir_ / "gpt2" / "config.json")
        << R"({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 256, "n_embd": 64, )"
        << "\"n_layer\": " << layers << R"(, "n_head": 4, "n_positions": 64, "layer_norm_epsilon": 1e-5})";
    std::filesystem::create_directories(dir_ / "llama");
    std::ofstream(dir_ / "llama" / "config.json")
        << R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 259, "hidden_size": 64, )"
        << "\"num_hidden_layers\": " << layers
        << R"(, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, )"
        << R"("max_position_embeddings": 64, "rms_norm_eps": 1e-5, "attention_bias": true, "rope_theta": 10000.0, )"
        << R"("tie_word_embeddings": false, "hidden_act": "silu"})";
  }
  // `train` of dir_/model for `steps` steps of `batch` rows (plus `flags`), writing tag.jsonl
  // and tag/. AdamW's update is about lr · g / (|g| + eps): for the few elements whose gradient
  // cancels to ~eps, a reduction-order difference of the gradient moves the update by a visible
  // part of lr (gpt2: 1 element of 12,288 off by 1.3e-5 after one step at eps 1e-8, the rest
  // within 1e-6). eps 1e-6 keeps that response smooth, so the weights compare what the grid
  // computes (within 8e-7), not Adam's magnification of rounding.
  std::string train_args(const std::string& model, int64_t batch, const std::string& tag, int64_t steps,
                         const std::string& flags = "") const {
    return "train --model " + (dir_ / model).string() + " --threads 1 --seq 32 --warmup 1 --lr 1e-3 --eps 1e-6 --steps " +
           std::to_string(steps) + " --batch " + std::to_string(batch) + " --metrics " +
           (dir_ / (tag + ".jsonl")).string() + " --out " + (dir_ / tag).string() + " " + flags;
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  // `strata ARGS` as an np-rank mpirun job (np 0: plainly). Oversubscribed: 4 ranks on 2 cores.
  CliResult run(int np, const std::string& args, const std::string& tag, const std::string& env = "") {
    const std::filesystem::path o = dir_ / (tag + ".stdout"), e = dir_ / (tag + ".stderr");
    const std::string cmd = "timeout 180 " + launch_prefix(np, env) + std::string(STRATA_BIN) + " " + args + " >" +
                            o.string() + " 2>" + e.string();
    const int rc = std::system(cmd.c_str());
    return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, slurp(o), slurp(e)};
  }
  std::vector<nlohmann::json> metrics(const std::string& tag) const { return read_metrics(dir_ / (tag + ".jsonl")); }
  std::string losses(const std::string& tag) const {
    std::string s;
    for (const auto& j : metrics(tag)) s += j["loss"].dump() + " " + j["grad_norm"].dump() + "\n";
    return s;
  }
  std::map<std::string, std::vector<float>> weights(const std::string& tag) const {
    return tensors_of(*HfCheckpoint::open(dir_ / tag));
  }
  bool same_weights(const std::string& a, const std::string& b) const {
    return slurp(dir_ / a / "model.safetensors") == slurp(dir_ / b / "model.safetensors");
  }
  // Run b's steps (from its first) against run a's last ones, and their saved weights, to fp32
  // tolerance: losses and norms within 1e-5 relative, every weight within 1e-5.
  void expect_close(const std::string& a, const std::string& b) const {
    const auto ma = metrics(a), mb = metrics(b);
    ASSERT_FALSE(mb.empty()) << b;
    ASSERT_GE(ma.size(), mb.size()) << a << " / " << b;
    const size_t skip = ma.size() - mb.size();
    for (size_t i = 0; i < mb.size(); ++i) {
      EXPECT_EQ(ma[skip + i]["step"], mb[i]["step"]);
      EXPECT_LT(rel(ma[skip + i]["loss"].get<double>(), mb[i]["loss"].get<double>()), 1e-5) << b << " step " << i + 1;
      EXPECT_LT(rel(ma[skip + i]["grad_norm"].get<double>(), mb[i]["grad_norm"].get<double>()), 1e-5)
          << b << " step " << i + 1;
    }
    const auto wa = weights(a), wb = weights(b);
    ASSERT_EQ(wa.size(), wb.size()) << b;
    for (const auto& [name, va] : wa) {
      ASSERT_TRUE(wb.count(name)) << b << " lacks " << name;
      const auto& vb = wb.at(name);
      ASSERT_EQ(va.size(), vb.size()) << b << ": " << name;
      double worst = 0;
      for (size_t i = 0; i < va.size(); ++i) worst = std::max(worst, std::abs(double(va[i]) - vb[i]));
      EXPECT_LT(worst, 1e-5) << b << ": " << name;
    }
  }
  // Chat documents (examples/sft, byte tokenizer) written once into dir_/data; the flags that
  // train on them packed, validating every 2 steps on 4 held-out batches.
  std::string document_flags() {
    const std::string src = STRATA_SOURCE_DIR;
    if (!std::filesystem::exists(dir_ / "data")) {
      CliResult d = run(0, "data --tokenizer " + src + "/tests/text/fixtures/tokenizers/bytes --in " + src +
                               "/examples/sft/conversations.jsonl --format chat --val-docs 40 --quiet --out " +
                               (dir_ / "data").string(), "data");
      EXPECT_EQ(d.status, 0) << d.err;
    }
    return "--data " + (dir_ / "data" / "train_*.bin").string() + " --val-data " +
           (dir_ / "data" / "val_*.bin").string() + " --eval-every 2 --eval-batches 4 --pack on ";
  }
  // Runs a and b report the same steps' losses and validation losses (within `tol` relative) and
  // trained tokens; at least two validations.
  void expect_same_evaluations(const std::string& a, const std::string& b, double tol) const {
    const auto ma = metrics(a), mb = metrics(b);
    ASSERT_EQ(ma.size(), mb.size()) << b;
    int vals = 0;
    for (size_t i = 0; i < ma.size(); ++i) {
      for (const char* k : {"loss", "val_loss"}) {
        ASSERT_EQ(ma[i].contains(k), mb[i].contains(k)) << b << " line " << i;
        if (ma[i].contains(k) && !ma[i][k].is_null()) {
          EXPECT_LT(rel(ma[i][k].get<double>(), mb[i][k].get<double>()), tol) << b << " " << k << " line " << i;
          vals += std::string(k) == "val_loss";
        }
      }
      EXPECT_EQ(ma[i].value("trained_tokens", -1), mb[i].value("trained_tokens", -1)) << b;
    }
    EXPECT_GE(vals, 2) << b;
  }
  // A checkpoint resumes on another grid: `args(tag)` trains 4 steps checkpointing every 2;
  // the grid's run (np ranks, `grid` flags) resumes on 1 rank and the 1-rank run's on the grid,
  // each continuing its run to fp32 tolerance; on the same grid a resume is the run itself, bit
  // for bit.
  void expect_resumes_across_grids(const std::function<std::string(const std::string&)>& args, int np,
                                   const std::string& grid) {
    const std::string ckg = (dir_ / "ckg").string(), ck1 = (dir_ / "ck1").string();
    const std::string every = "--checkpoint-every 2 --checkpoint-dir ";
    CliResult g = run(np, args("g") + grid + " " + every + ckg, "g");
    ASSERT_EQ(g.status, 0) << g.err;
    CliResult one = run(0, args("one") + every + ck1, "one");
    ASSERT_EQ(one.status, 0) << one.err;
    CliResult a = run(0, args("a") + "--resume " + ckg + "/step-00000002", "a");
    ASSERT_EQ(a.status, 0) << a.err;
    CliResult b = run(np, args("b") + grid + " --resume " + ck1 + "/step-00000002", "b");
    ASSERT_EQ(b.status, 0) << b.err;
    EXPECT_NE(b.out.find("resumed"), std::string::npos) << b.out;
    expect_close("g", "a");
    expect_close("one", "b");
    CliResult c = run(np, args("c") + grid + " --resume " + ckg + "/step-00000002", "c");
    ASSERT_EQ(c.status, 0) << c.err;
    EXPECT_TRUE(same_weights("c", "g"));
  }
  // Rank 1 killed at step 3 of `args` (an np-rank job) takes the job down within 30 s, naming it.
  void expect_killed_rank_stops_the_job(int np, const std::string& args) {
    const auto t0 = std::chrono::steady_clock::now();
    CliResult r = run(np, args, "kill", "STRATA_FAULT=kill:1:3");
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(r.status, 0) << r.out << r.err;
    EXPECT_LT(secs, 30) << "the job took " << secs << " s to stop";
    EXPECT_EQ(r.out.find("done:"), std::string::npos) << r.out;
    EXPECT_NE((r.out + r.err).find("rank 1"), std::string::npos) << r.out << r.err;
  }
  std::filesystem::path dir_;
};

}  // namespace strata::test
