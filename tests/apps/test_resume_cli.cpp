// Training checkpoints and resume, end to end through the built binary: 10 steps == 5 steps +
// resume + 5 steps bitwise (losses, grad norms, saved weights) for all-resident, optimizer on
// NVMe and everything on NVMe, and across placements; corrupt checkpoints are named; rotation
// keeps the newest; a signal writes a checkpoint that resumes; `strata inspect` verifies.
#include <gtest/gtest.h>

#include "tests/apps/cli_test_util.h"
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;

namespace {

using strata::test::slurp;
using Result = strata::test::CliResult;

using strata::test::exact_metrics;

class ResumeCli : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string t = (fs::path(::testing::TempDir()) / "strata_resume_XXXXXX").string();
    ASSERT_NE(::mkdtemp(t.data()), nullptr);
    dir_ = t;
    fs::create_directories(swap());
    fs::create_directories(dir_ / "tiny");
    std::ofstream(dir_ / "tiny" / "config.json") << R"({
      "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
      "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
      "intermediate_size": 128, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
      "rope_theta": 10000.0, "tie_word_embeddings": false, "hidden_act": "silu"})";
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path swap() const { return dir_ / "swap"; }
  std::string base(int steps) const {
    return "train --model " + (dir_ / "tiny").string() + " --threads 1 --batch 2 --seq 16 --warmup 2 --steps " +
           std::to_string(steps) + " ";
  }
  std::string placement(const std::string& which) const {
    if (which == "resident") return "";
    if (which == "optimizer-nvme") return "--offload-optimizer nvme --nvme-path " + swap().string() + " ";
    if (which == "twin") return "--offload-optimizer nvme --optimizer-on-device 0.6 --nvme-path " + swap().string() + " ";
    return "--offload-optimizer nvme --offload-grads nvme --offload-params nvme --checkpoint-activations full "
           "--host-mem 1M --nvme-path " +
           swap().string() + " ";
  }
  Result run(const std::string& args) { return strata::test::run_strata(dir_, args); }
  // 10 steps at once (reference) vs a run that checkpoints at 5 then a run resumed from step 5.
  void expect_resume_exact(const std::string& save_placement, const std::string& resume_placement,
                           const std::string& extra = "") {
    const fs::path a = dir_ / "a", b = dir_ / "b";
    fs::create_directories(a);
    fs::create_directories(b);
    Result r = run(base(10) + placement(save_placement) + extra + "--metrics " + (a / "m.jsonl").string() + " --out " +
                   (a / "model").string());
    ASSERT_EQ(r.status, 0) << r.err;
    r = run(base(10) + placement(save_placement) + extra + "--checkpoint-dir " + (b / "ck").string() +
            " --checkpoint-every 5 --keep 5");
    ASSERT_EQ(r.status, 0) << r.err;
    ASSERT_TRUE(fs::exists(b / "ck" / "step-00000005" / "trainer.json"));
    r = run(base(10) + placement(resume_placement) + extra + "--resume " + (b / "ck" / "step-00000005").string() +
            " --metrics " + (b / "m.jsonl").string() + " --out " + (b / "model").string());
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("resumed    from"), std::string::npos) << r.out;
    const auto ref = exact_metrics(a / "m.jsonl"), got = exact_metrics(b / "m.jsonl");
    ASSERT_EQ(ref.size(), 10u);
    ASSERT_EQ(got.size(), 5u);
    for (size_t i = 0; i < 5; ++i) EXPECT_EQ(got[i], ref[5 + i]) << "step " << 6 + i;
    EXPECT_TRUE(slurp(b / "model" / "model.safetensors") == slurp(a / "model" / "model.safetensors"))
        << "final weights differ";
    EXPECT_TRUE(fs::is_empty(swap()));
  }
  fs::path dir_;
};

TEST_F(ResumeCli, BitExactAllResident) { expect_resume_exact("resident", "resident"); }
TEST_F(ResumeCli, BitExactOptimizerOnNvme) { expect_resume_exact("optimizer-nvme", "optimizer-nvme"); }
TEST_F(ResumeCli, BitExactEverythingOnNvme) { expect_resume_exact("all-nvme", "all-nvme"); }
TEST_F(ResumeCli, BitExactAcrossPlacements) {
  expect_resume_exact("resident", "all-nvme");
  fs::remove_all(dir_ / "a");
  fs::remove_all(dir_ / "b");
  expect_resume_exact("all-nvme", "optimizer-nvme");
}
// Twin-Flow's split (part of the optimizer on the device, the rest on NVMe) checkpoints and
// resumes bit-exact, into the split and out of it.
TEST_F(ResumeCli, BitExactAcrossTheTwinFlowSplit) {
  expect_resume_exact("twin", "resident");
  fs::remove_all(dir_ / "a");
  fs::remove_all(dir_ / "b");
  expect_resume_exact("optimizer-nvme", "twin");
}
// fp16 (loss scaling on) resumes bit-exact too. Starting at 2^20 the scaled gradients overflow
// fp16 in some early steps (1, 2 and 4 here, and 8 after the resume), so the checkpoint at step
// 5 holds a halved scale, a good-step count and skipped steps (AdamW's step count lags the
// run's): the resumed run must continue all three exactly.
TEST_F(ResumeCli, BitExactFp16LossScaler) {
  expect_resume_exact("resident", "resident", "--dtype fp16 --loss-scale 1048576 ");
  std::istringstream lines(slurp(dir_ / "a" / "m.jsonl"));
  std::string line;
  int skipped_before_ckpt = 0;  // an overflowed step reports no grad norm
  for (int i = 0; i < 5 && std::getline(lines, line); ++i)
    skipped_before_ckpt += line.find("\"grad_norm\":null") != std::string::npos;
  EXPECT_GE(skipped_before_ckpt, 1) << "no fp16 overflow before the checkpoint: the scaler's restore is not exercised";
  EXPECT_LT(skipped_before_ckpt, 5) << "every step overflowed: nothing was trained";
}
// --speculate with a clip below every norm and fp16 overflows: every step's update in the
// backward is rolled back and redone (or skipped). The checkpoint at step 5 is taken between
// rollbacks: the resumed run is bitwise the run without breaks, and that is bitwise the run
// whose update waits for the norm.
TEST_F(ResumeCli, BitExactInARollbackHeavySpeculativeRun) {
  const std::string flags = "--dtype fp16 --loss-scale 1048576 --grad-clip 1e-3 ";
  expect_resume_exact("optimizer-nvme", "resident", flags + "--speculate on ");
  std::istringstream lines(slurp(dir_ / "a" / "m.jsonl"));
  int rolled = 0;
  for (std::string line; std::getline(lines, line);) rolled += line.find("\"rolled_back\":true") != std::string::npos;
  EXPECT_EQ(rolled, 10);
  const fs::path c = dir_ / "c";
  fs::create_directories(c);
  Result r = run(base(10) + placement("optimizer-nvme") + flags + "--speculate off --metrics " +
                 (c / "m.jsonl").string() + " --out " + (c / "model").string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(exact_metrics(c / "m.jsonl"), exact_metrics(dir_ / "a" / "m.jsonl"));
  EXPECT_TRUE(slurp(c / "model" / "model.safetensors") == slurp(dir_ / "a" / "model" / "model.safetensors"));
}
// --speculate auto: the checkpoint at step 5 falls inside its trial (steps 1-3 speculate, 4-6
// wait); the resumed run starts a trial of its own, and every way is bitwise the same run.
TEST_F(ResumeCli, BitExactThroughSpeculateAutosTrial) {
  expect_resume_exact("optimizer-nvme", "optimizer-nvme", "--speculate auto --speculate-trial 3 ");
  std::istringstream lines(slurp(dir_ / "a" / "m.jsonl"));
  int speculated = 0;
  for (std::string line; std::getline(lines, line);) speculated += line.find("\"speculated\":true") != std::string::npos;
  EXPECT_GE(speculated, 3);  // the trial's first way
  EXPECT_LE(speculated, 7);  // (at most steps 7-10 after it)
  // The resumed run's own trial: steps 6-8 speculate, 9-10 wait.
  std::vector<bool> resumed;
  for (const auto& j : strata::test::read_metrics(dir_ / "b" / "m.jsonl")) resumed.push_back(j["speculated"].get<bool>());
  EXPECT_EQ(resumed, (std::vector<bool>{true, true, true, false, false}));
}
TEST_F(ResumeCli, BitExactBf16WithAccumulation) { expect_resume_exact("optimizer-nvme", "resident", "--dtype bf16 --grad-accum 2 "); }
// Without clipping each unit updates in the backward (nothing is left pending at a step's end):
// a checkpoint and its resume, offloaded or not, continue bit for bit.
TEST_F(ResumeCli, BitExactWithTheUpdateInTheBackward) {
  expect_resume_exact("all-nvme", "resident", "--dtype bf16 --grad-clip 0 ");
}

TEST_F(ResumeCli, RotationKeepsTheNewestAndLatestPointsAtIt) {
  const fs::path ck = dir_ / "ck";
  const Result r = run(base(8) + "--checkpoint-dir " + ck.string() + " --checkpoint-every 2 --keep 2");
  ASSERT_EQ(r.status, 0) << r.err;
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(ck)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step-00000006", "step-00000008"}));
  EXPECT_EQ(slurp(ck / "latest"), "step-00000008\n");
}

TEST_F(ResumeCli, CorruptCheckpointIsNamedAndRefused) {
  const fs::path ck = dir_ / "ck";
  ASSERT_EQ(run(base(4) + "--checkpoint-dir " + ck.string() + " --checkpoint-every 2").status, 0);
  const fs::path f = ck / "step-00000002" / "optimizer.safetensors";
  {
    std::fstream s(f, std::ios::in | std::ios::out | std::ios::binary);
    s.seekp(static_cast<std::streamoff>(fs::file_size(f) - 5));
    s.put('\x7f');
  }
  Result r = run(base(4) + "--resume " + (ck / "step-00000002").string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("optimizer.safetensors"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("checksum"), std::string::npos) << r.err;
  r = run("inspect " + (ck / "step-00000002").string());
  EXPECT_NE(r.status, 0);
  // A truncated file is named too.
  fs::resize_file(ck / "step-00000004" / "model.safetensors", 100);
  r = run(base(6) + "--checkpoint-dir " + ck.string() + " --resume auto");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("model.safetensors"), std::string::npos) << r.err;
}

TEST_F(ResumeCli, AutoStartsFreshThenResumesAndRefusesNothingLeft) {
  const fs::path ck = dir_ / "ck";
  Result r = run(base(3) + "--checkpoint-dir " + ck.string() + " --resume auto");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out.find("resumed"), std::string::npos);
  EXPECT_TRUE(fs::exists(ck / "step-00000003"));  // at the end
  r = run(base(3) + "--checkpoint-dir " + ck.string() + " --resume auto");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("nothing left to train"), std::string::npos) << r.err;
  r = run(base(5) + "--checkpoint-dir " + ck.string() + " --resume auto");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("at step 3 of 5"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("changed since the checkpoint: --steps 5 (was 3)"), std::string::npos) << r.out;
  // Another model is refused.
  fs::create_directories(dir_ / "other");
  std::string cfg = slurp(dir_ / "tiny" / "config.json");
  cfg.replace(cfg.find("\"intermediate_size\": 128"), 24, "\"intermediate_size\": 192");
  std::ofstream(dir_ / "other" / "config.json") << cfg;
  r = run("train --model " + (dir_ / "other").string() + " --threads 1 --batch 2 --seq 16 --steps 9 --checkpoint-dir " +
          ck.string() + " --resume auto");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("differs"), std::string::npos) << r.err;
}

TEST_F(ResumeCli, InspectSummarisesAndVerifies) {
  const fs::path ck = dir_ / "ck";
  ASSERT_EQ(run(base(2) + "--checkpoint-dir " + ck.string() + " --out " + (dir_ / "model").string()).status, 0);
  Result r = run("inspect " + ck.string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("training checkpoint"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step       2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("OK"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("all finite"), std::string::npos) << r.out;
  r = run("inspect --tensors " + (dir_ / "model").string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("model.embed_tokens.weight"), std::string::npos) << r.out;
  r = run("inspect " + (dir_ / "nope").string());
  EXPECT_NE(r.status, 0);
}

// SIGTERM mid-run: the step finishes, a checkpoint is written and named, swap files go, and
// --resume auto continues from it.
TEST_F(ResumeCli, SignalWritesACheckpointThatResumes) {
  const fs::path ck = dir_ / "ck", out = dir_ / "sig.txt";
  const std::string args = base(100000) + placement("optimizer-nvme") + "--checkpoint-dir " + ck.string();
  const pid_t pid = ::fork();
  if (pid == 0) {
    const std::string cmd = "exec " + std::string(STRATA_BIN) + " " + args + " >" + out.string() + " 2>&1";
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  const auto t0 = std::chrono::steady_clock::now();
  while (slurp(out).find("step      2/") == std::string::npos &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const std::string text = slurp(out);
  ASSERT_TRUE(WIFEXITED(status)) << text;
  EXPECT_EQ(WEXITSTATUS(status), 143) << text;
  EXPECT_NE(text.find("checkpoint " + ck.string()), std::string::npos) << text;
  EXPECT_TRUE(fs::is_empty(swap()));
  const std::string latest = slurp(ck / "latest");
  ASSERT_FALSE(latest.empty());
  const int64_t at = std::stoll(latest.substr(5));
  const Result r = run(base(static_cast<int>(at) + 2) + "--checkpoint-dir " + ck.string() + " --resume auto");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("at step " + std::to_string(at)), std::string::npos) << r.out;
}

// Resuming into the same --metrics file: lines of steps past the checkpoint (written by the run
// after its last checkpoint) are dropped, so every step appears once, with the same values.
TEST_F(ResumeCli, MetricsOfAResumedRunHaveEachStepOnce) {
  const fs::path ck = dir_ / "ck", m = dir_ / "m.jsonl";
  ASSERT_EQ(run(base(6) + "--checkpoint-dir " + ck.string() + " --checkpoint-every 3 --keep 3 --metrics " + m.string()).status, 0);
  const auto before = exact_metrics(m);
  ASSERT_EQ(before.size(), 6u);
  const Result r = run(base(6) + "--resume " + (ck / "step-00000003").string() + " --metrics " + m.string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(exact_metrics(m), before);
}

// A run killed while writing leaves .tmp-<pid>-XXXXXX; the next run removes it (only that).
TEST_F(ResumeCli, IncompleteCheckpointsOfKilledRunsAreRemoved) {
  const fs::path ck = dir_ / "ck";
  fs::create_directories(ck / ".tmp-999999999-abcdef");
  std::ofstream(ck / ".tmp-999999999-abcdef" / "model.safetensors") << "partial";
  fs::create_directories(ck / "mine");
  const Result r = run(base(1) + "--checkpoint-dir " + ck.string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_FALSE(fs::exists(ck / ".tmp-999999999-abcdef"));
  EXPECT_TRUE(fs::exists(ck / "mine"));
}

}  // namespace
