// Supervised fine-tuning through the CLI (issue "Train on conversations"): `strata data --format
// chat` on the shipped conversation set, then `strata train` on its documents and loss masks —
// packed and one per row, trained-target counts and validation in the metrics, evaluation that
// changes no bit of training, the masked mean equal across accumulation and ranks, placements
// and ZeRO stages bitwise with packing, resume with shuffling bit-exact, epochs, errors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_test_util.h"
#include "src/data/doc_shards.h"
#include "src/data/token_shards.h"

namespace fs = std::filesystem;
using strata::test::CliResult;
using strata::test::slurp;

namespace {

#ifdef STRATA_MPIEXEC
constexpr const char* kMpiexec = STRATA_MPIEXEC;
#else
constexpr const char* kMpiexec = "";
#endif

class SftCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = strata::test::make_scratch_dir("strata_sft");
    ASSERT_FALSE(dir_.empty());
    strata::test::write_tiny_llama(dir_ / "tiny", 32, 2, 64);
    const std::string src = STRATA_SOURCE_DIR;
    const CliResult r = run("data --tokenizer " + src + "/tests/text/fixtures/tokenizers/bytes --in " + src +
                            "/examples/sft/conversations.jsonl --format chat --val-docs 40 --quiet --out " +
                            (dir_ / "data").string());
    ASSERT_EQ(r.status, 0) << r.err;
    // The model directory has the tokenizer the data was made with (as a hub model does).
    for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
      fs::copy_file(src + "/tests/text/fixtures/tokenizers/bytes/" + f, dir_ / "tiny" / f);
  }
  void TearDown() override { fs::remove_all(dir_); }
  CliResult run(const std::string& args, int np = 0) {
    if (np == 0) return strata::test::run_strata(dir_, args);
    const fs::path o = dir_ / "mpi.stdout", e = dir_ / "mpi.stderr";
    std::string cmd = "timeout 120 env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
                      "OMPI_MCA_rmaps_base_oversubscribe=1 ";
    cmd += std::string(kMpiexec) + " -np " + std::to_string(np) + " " + STRATA_BIN + " " + args + " >" + o.string() +
           " 2>" + e.string();
    const int rc = std::system(cmd.c_str());
    return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, slurp(o), slurp(e)};
  }
  std::string train(int steps, const std::string& batch = "--batch 2") const {
    return "train --model " + (dir_ / "tiny").string() + " --data " + (dir_ / "data" / "train_*.bin").string() +
           " --threads 1 --seq 64 --warmup 2 --lr 3e-3 --steps " + std::to_string(steps) + " " + batch + " ";
  }
  std::string val() const { return "--val-data " + (dir_ / "data" / "val_*.bin").string() + " "; }
  std::string outputs(const std::string& tag) const {
    return " --metrics " + (dir_ / (tag + ".jsonl")).string() + " --out " + (dir_ / tag).string() + " ";
  }
  std::vector<nlohmann::json> metrics(const std::string& tag) const {
    return strata::test::read_metrics(dir_ / (tag + ".jsonl"));
  }
  // The training steps' losses and norms exactly (lines with a loss), and the saved weights.
  std::string outcome(const std::string& tag) const {
    std::string s;
    for (const auto& j : metrics(tag))
      if (j.contains("loss")) s += j["loss"].dump() + " " + j["grad_norm"].dump() + " " + j["trained_tokens"].dump() + "\n";
    return s + slurp(dir_ / tag / "model.safetensors");
  }
  fs::path dir_;
};

double rel(double a, double b) { return std::abs(a - b) / std::max({std::abs(a), std::abs(b), 1e-30}); }

TEST_F(SftCli, PackedRunReportsTrainedTargetsAndValidation) {
  const CliResult r = run(train(4) + val() + "--pack on --eval-every 2" + outputs("a"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("rows from documents, packed"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("loss mask"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("eval 0/4 | val loss"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("eval 4/4 | val loss"), std::string::npos) << r.out;
  const auto m = metrics("a");
  ASSERT_EQ(m.size(), 5u);  // the start's validation, then 4 steps
  EXPECT_EQ(m[0]["step"], 0);
  EXPECT_GT(m[0]["val_loss"].get<double>(), 0);
  for (size_t i = 1; i < 5; ++i) {
    const int64_t trained = m[i]["trained_tokens"].get<int64_t>();
    EXPECT_GT(trained, 0) << i;
    EXPECT_LT(trained, 2 * 64) << i;  // prompts, templates and row ends are not trained
    EXPECT_EQ(m[i].contains("val_loss"), i % 2 == 0) << i;
  }
  EXPECT_LT(m[4]["val_loss"].get<double>(), m[0]["val_loss"].get<double>());
  // --out carries the tokenizer of --model: the saved model tokenizes and chats as its source.
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
    EXPECT_TRUE(slurp(dir_ / "a" / f) == slurp(dir_ / "tiny" / f)) << f;
}

// Validation runs forward passes between steps; training must not move by a bit, whether the
// update runs in the next forward (clipping on: validation applies it first) or in the backward.
TEST_F(SftCli, EvaluationNeverChangesTraining) {
  for (const std::string clip : {"1", "0"}) {
    SCOPED_TRACE(std::string("--grad-clip ") += clip);
    std::string common = train(5) + "--pack on --grad-clip ";
    common += clip + " ";
    ASSERT_EQ(run(common + outputs(std::string("plain") += clip)).status, 0);
    const CliResult r = run(common + val() + "--eval-every 2 --eval-batches 3" + outputs(std::string("eval") += clip));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("in 3 batches"), std::string::npos) << r.out;
    EXPECT_TRUE(outcome(std::string("plain") += clip) == outcome(std::string("eval") += clip));
  }
}

// The loss is Σ CE over the global batch's trained targets / their count: the same rows as one
// micro-batch of 4, four of 1, or spread over 2 ranks give the same loss and norm (reduction
// order apart) and exactly the same count.
TEST_F(SftCli, MaskedMeanIsTheSameAcrossAccumulationAndRanks) {
  ASSERT_EQ(run(train(3, "--batch 4") + "--pack on" + outputs("b4")).status, 0);
  ASSERT_EQ(run(train(3, "--batch 1 --grad-accum 4") + "--pack on" + outputs("a4")).status, 0);
  std::vector<std::string> tags = {"a4"};
  if (std::string(kMpiexec).empty()) {
    GTEST_LOG_(INFO) << "no mpirun: the 2-rank runs did not run";
  } else {
    const CliResult r = run(train(3, "--batch 2") + "--pack on" + outputs("r2"), 2);
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    ASSERT_EQ(run(train(3, "--batch 1 --grad-accum 2") + "--pack on" + outputs("r2a2"), 2).status, 0);
    tags.push_back("r2");
    tags.push_back("r2a2");
  }
  const auto ref = metrics("b4");
  ASSERT_EQ(ref.size(), 3u);
  for (const std::string& t : tags) {
    const auto m = metrics(t);
    ASSERT_EQ(m.size(), 3u) << t;
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(m[i]["trained_tokens"], ref[i]["trained_tokens"]) << t << " step " << i + 1;
      EXPECT_LT(rel(m[i]["loss"].get<double>(), ref[i]["loss"].get<double>()), 1e-5) << t << " step " << i + 1;
      EXPECT_LT(rel(m[i]["grad_norm"].get<double>(), ref[i]["grad_norm"].get<double>()), 1e-4) << t << " step " << i + 1;
    }
  }
}

// Masks and packing change no placement rule: offloaded, checkpointed runs are bitwise the
// resident one, and so are the ZeRO stages of a 2-rank job.
TEST_F(SftCli, PlacementsAndStagesStayBitwiseWithPacking) {
  fs::create_directories(dir_ / "swap");
  const std::string common = train(3) + "--pack on --dtype bf16 ";
  ASSERT_EQ(run(common + outputs("res")).status, 0);
  const CliResult r = run(common +
                          "--offload-params cpu --offload-grads nvme --offload-optimizer nvme --checkpoint-activations "
                          "full --offload-activations cpu --nvme-path " +
                          (dir_ / "swap").string() + outputs("off"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(outcome("res") == outcome("off"));
  if (std::string(kMpiexec).empty()) GTEST_SKIP() << "no mpirun: the ZeRO stages did not run";
  for (int stage : {0, 3}) {
    const CliResult z = run(common + "--zero-stage " + std::to_string(stage) + outputs(std::string("z") += std::to_string(stage)), 2);
    ASSERT_EQ(z.status, 0) << z.err;
  }
  EXPECT_TRUE(outcome("z0") == outcome("z3"));
}

// A shuffled, packed run stopped at a checkpoint and resumed continues with the same rows: the
// same losses and weights as the run that never stopped.
TEST_F(SftCli, ResumeWithShufflingIsBitExact) {
  const std::string common = train(6) + "--pack on --shuffle --seed 5 ";
  ASSERT_EQ(run(common + outputs("whole")).status, 0);
  ASSERT_EQ(run(common + "--checkpoint-every 3 --keep 3 --checkpoint-dir " + (dir_ / "ck").string()).status, 0);
  const CliResult r = run(common + "--resume " + (dir_ / "ck" / "step-00000003").string() + outputs("resumed"));
  ASSERT_EQ(r.status, 0) << r.err;
  const auto a = metrics("whole"), b = metrics("resumed");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(b[i]["loss"].dump(), a[3 + i]["loss"].dump()) << "step " << 4 + i;
  EXPECT_TRUE(slurp(dir_ / "whole" / "model.safetensors") == slurp(dir_ / "resumed" / "model.safetensors"));
}

// --epochs without --steps: as many steps as the epochs' rows take.
TEST_F(SftCli, EpochsSetTheNumberOfSteps) {
  const std::string data = (dir_ / "data" / "val_*.bin").string();  // 40 documents: quick
  const CliResult r = run("train --model " + (dir_ / "tiny").string() + " --data " + data +
                          " --threads 1 --seq 64 --batch 4 --warmup 1 --epochs 2 --pack on");
  ASSERT_EQ(r.status, 0) << r.err;
  const size_t at = r.out.find(" epochs = ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const int64_t rows = std::stoll(r.out.substr(at + 10));
  const int64_t steps = (rows + 3) / 4;
  EXPECT_NE(r.out.find((std::string("done: ") += std::to_string(steps)) += " steps"), std::string::npos) << r.out;
}

// The trainer end to end: the same documents one per row, packed two to a row, or one per row
// with twice the padding give the same masked mean loss and the same gradient norm (weights held
// still by --lr 0). This fails if the trainer does not hand the rows' positions and segments to
// the model (packed documents would see each other) or divides by anything but the trained count
// (padding would shrink the gradient).
TEST_F(SftCli, PackingAndPaddingChangeNeitherLossNorGradient) {
  {
    strata::ShardSetWriter w(dir_, "fixed", 1 << 20, 1);
    for (uint32_t d = 0; d < 8; ++d) {
      std::vector<uint32_t> ids(17);
      std::vector<uint8_t> mask(17);
      for (uint32_t i = 0; i < 17; ++i) ids[i] = (d * 37 + i * 11) % 200 + 20, mask[i] = (d + i) % 3 != 0;
      w.add_document(ids.data(), mask.data(), ids.size());
    }
    w.finish();
  }
  const std::string common = "train --model " + (dir_ / "tiny").string() + " --data " + (dir_ / "fixed_*.bin").string() +
                             " --threads 1 --lr 0 --steps 2 ";
  ASSERT_EQ(run(common + "--seq 33 --batch 4 --pack off" + outputs("rows")).status, 0);
  ASSERT_EQ(run(common + "--seq 33 --batch 2 --pack on" + outputs("packed")).status, 0);  // 17 + 17 = 34 slots
  ASSERT_EQ(run(common + "--seq 64 --batch 4 --pack off" + outputs("padded")).status, 0);
  const auto ref = metrics("rows");
  ASSERT_EQ(ref.size(), 2u);
  for (const std::string tag : {"packed", "padded"}) {
    const auto m = metrics(tag);
    ASSERT_EQ(m.size(), 2u) << tag;
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(m[i]["trained_tokens"], ref[i]["trained_tokens"]) << tag;
      EXPECT_LT(rel(m[i]["loss"].get<double>(), ref[i]["loss"].get<double>()), 1e-5) << tag << " step " << i + 1;
      EXPECT_LT(rel(m[i]["grad_norm"].get<double>(), ref[i]["grad_norm"].get<double>()), 1e-4) << tag << " step " << i + 1;
    }
  }
}

// Held-out shards without document offsets are a stream: by default every window of one pass.
TEST_F(SftCli, StreamValidationCoversOnePass) {
  std::vector<uint32_t> ids(3 * 2 * 64 + 10);  // three windows of B·T = 128 tokens (+1), and a rest
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint32_t>(i * 7 % 256);
  strata::write_token_shard(dir_ / "plain_val.bin", ids, 1);
  const CliResult r = run(train(1) + "--val-data " + (dir_ / "plain_val.bin").string() + outputs("sv"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("384 tokens in 3 batches"), std::string::npos) << r.out;
}

TEST_F(SftCli, FlagsThatNeedDocumentsAndNothingToTrain) {
  CliResult r = run("train --steps 1 --pack on");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--pack on works on documents"), std::string::npos) << r.err;
  r = run(train(1) + "--pack sometimes");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--pack sometimes: must be off"), std::string::npos) << r.err;
  r = run(train(1) + "--eval-every 2");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("need --val-data"), std::string::npos) << r.err;
  // A data set whose every token is masked: each step is skipped with a warning, nothing divides
  // by zero, the run ends normally.
  {
    strata::ShardSetWriter w(dir_, "masked", 1000, 1);
    const std::vector<uint32_t> ids(50, 65);
    const std::vector<uint8_t> mask(50, 0);
    for (int d = 0; d < 4; ++d) w.add_document(ids.data(), mask.data(), ids.size());
    w.finish();
  }
  r = run("train --model " + (dir_ / "tiny").string() + " --data " + (dir_ / "masked_*.bin").string() +
          " --threads 1 --seq 64 --batch 2 --steps 2 --metrics " + (dir_ / "masked.jsonl").string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("no trained target"), std::string::npos) << r.err;
  const auto m = metrics("masked");
  ASSERT_EQ(m.size(), 2u);
  EXPECT_TRUE(m[0]["loss"].is_null());
  EXPECT_EQ(m[0]["trained_tokens"], 0);
}

}  // namespace
