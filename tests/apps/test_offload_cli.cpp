// `strata train` with state on NVMe, end to end through the built binary: a failing disk (EIO
// on a read or a write mid-run) and a full one (ENOSPC when the swap files grow) end the run
// with one line naming the path and the operation and a non-zero exit, leave an earlier --out
// intact, and leave no swap files; so does a bit flipped on disk (caught by the checksums); SIGINT/SIGTERM stop after the current step (130/143) and a
// second SIGINT at once, removing the swap files either way.
#include <gtest/gtest.h>

#include "tests/apps/cli_test_util.h"
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

namespace fs = std::filesystem;

namespace {

using strata::test::slurp;
using Result = strata::test::CliResult;

class OffloadCli : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string t = (fs::path(::testing::TempDir()) / "strata_ocli_XXXXXX").string();
    ASSERT_NE(::mkdtemp(t.data()), nullptr);
    dir_ = t;
    fs::create_directories(swap());
    // A small llama (4 blocks of 128): every run is quick, and a 3 MiB host budget keeps only a
    // few units there, so every step reads and writes NVMe.
    fs::create_directories(dir_ / "tiny");
    std::ofstream(dir_ / "tiny" / "config.json") << R"({
      "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
      "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
      "intermediate_size": 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
      "rope_theta": 10000.0, "tie_word_embeddings": false, "hidden_act": "silu"})";
  }
  void TearDown() override {
    if (mounted_) ::umount2(swap().c_str(), MNT_DETACH);
    fs::remove_all(dir_);
  }
  fs::path swap() const { return dir_ / "swap"; }
  std::string nvme_args() const {
    return "--model " + (dir_ / "tiny").string() +
           " --threads 1 --seq 32 --host-mem 3M --offload-optimizer nvme --offload-grads nvme --offload-params nvme "
           "--nvme-path " + swap().string() + " ";
  }
  Result run(const std::string& args, const std::string& env = "") { return strata::test::run_strata(dir_, args, env); }
  // A model saved by an earlier, finished run: a failed run must leave it as it was.
  std::string save_earlier_model() {
    const Result r = run("train --model " + (dir_ / "tiny").string() + " --threads 1 --steps 1 --seq 16 --out " +
                         (dir_ / "model").string());
    EXPECT_EQ(r.status, 0) << r.err;
    return slurp(dir_ / "model" / "model.safetensors");
  }
  void expect_one_line_error(const Result& r, const std::string& what) {
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find(what), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(swap().string()), std::string::npos) << r.err;  // the path
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_TRUE(fs::is_empty(swap())) << "swap files left behind";
  }
  fs::path dir_;
  bool mounted_ = false;
};

// The jitter keeps the compute stream running ahead when the read fails on the host: the
// streams must finish before the pools they write into are freed (it crashed there once).
TEST_F(OffloadCli, ReadErrorMidRunIsOneLineAndKeepsOut) {
  const std::string before = save_earlier_model();
  const Result r = run("train " + nvme_args() + "--steps 4 --out " + (dir_ / "model").string(),
                       "STRATA_FAULT=${STRATA_FAULT:+$STRATA_FAULT,}io-read:60 STRATA_TEST_STREAM_JITTER_US=300");
  expect_one_line_error(r, "read ");
  EXPECT_NE(r.err.find("Input/output error"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("step 1/4"), std::string::npos) << "the fault should hit mid-run:\n" << r.out;
  EXPECT_EQ(slurp(dir_ / "model" / "model.safetensors"), before);
}

TEST_F(OffloadCli, WriteErrorMidRunIsOneLineAndKeepsOut) {
  const std::string before = save_earlier_model();
  const Result r = run("train " + nvme_args() + "--steps 4 --out " + (dir_ / "model").string(),
                       "STRATA_FAULT=${STRATA_FAULT:+$STRATA_FAULT,}io-write:60 STRATA_TEST_STREAM_JITTER_US=300");
  EXPECT_NE(r.out.find("step 1/4"), std::string::npos) << "the fault should hit mid-run:\n" << r.out;
  expect_one_line_error(r, "write ");
  EXPECT_EQ(slurp(dir_ / "model" / "model.safetensors"), before);
}

// Silent corruption: one bit of the swap file flips after a write mid-run (the test hook does
// it behind the engine's back, as a bad drive would). The read-back is verified against the
// crc32c recorded at write time, so the run stops with one line naming the swap file, the byte
// offset and the block, instead of training on the corrupt state.
TEST_F(OffloadCli, BitFlipOnNvmeMidRunIsReportedNotTrainedOn) {
  const std::string before = save_earlier_model();
  const Result r = run("train " + nvme_args() + "--steps 4 --out " + (dir_ / "model").string(),
                       "STRATA_FAULT=${STRATA_FAULT:+$STRATA_FAULT,}io-flip:60");
  EXPECT_NE(r.out.find("step 1/4"), std::string::npos) << "the flip should hit mid-run:\n" << r.out;
  expect_one_line_error(r, "checksum mismatch reading swap file ");
  EXPECT_NE(r.err.find("/swap at byte offset "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("-byte block "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("offload block '"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("step 4/4"), std::string::npos) << r.out;
  EXPECT_EQ(slurp(dir_ / "model" / "model.safetensors"), before);
}

// --metrics' checksum_ms: the time the swap's checksums took in the step. Every step of the
// all-NVMe run moves bytes through the swap, so each has some; a run without NVMe has none. It
// is the step's own time, not the run's so far: ten steps' worth that never once falls would be
// a running total (ten timings in rising order by chance: about 1 in 3.6 million).
TEST_F(OffloadCli, MetricsCountTheChecksumsCpuTime) {
  ASSERT_EQ(run("train " + nvme_args() + "--steps 10 --metrics " + (dir_ / "nvme.jsonl").string()).status, 0);
  const auto nvme = strata::test::read_metrics(dir_ / "nvme.jsonl");
  ASSERT_EQ(nvme.size(), 10u);
  bool falls = false;
  for (size_t i = 1; i < nvme.size(); ++i)
    falls |= nvme[i]["checksum_ms"].get<double>() < nvme[i - 1]["checksum_ms"].get<double>();
  EXPECT_TRUE(falls) << "checksum_ms only rises: a running total, not the step's";
  for (const auto& j : nvme) {
    ASSERT_GT(j["host_to_nvme_bytes"].get<uint64_t>() + j["nvme_to_host_bytes"].get<uint64_t>(), 0u) << j.dump();
    EXPECT_GT(j["checksum_ms"].get<double>(), 0.0) << j.dump();
    EXPECT_LT(j["checksum_ms"].get<double>(), 2 * j["step_ms"].get<double>()) << j.dump();  // at most both threads' time
  }
  ASSERT_EQ(run("train --model " + (dir_ / "tiny").string() + " --threads 1 --seq 32 --steps 2 --metrics " +
                (dir_ / "resident.jsonl").string())
                .status,
            0);
  for (const auto& j : strata::test::read_metrics(dir_ / "resident.jsonl")) EXPECT_EQ(j["checksum_ms"].get<double>(), 0.0);
}

// The swap files are allocated (fallocate) before step 1: a disk without the room fails there.
TEST_F(OffloadCli, FullDiskIsOneLineBeforeTraining) {
  if (::mount("tmpfs", swap().c_str(), "tmpfs", 0, "size=1m") != 0)
    GTEST_SKIP() << "cannot mount a small tmpfs to fill (needs root): " << std::strerror(errno);
  mounted_ = true;
  const Result r = run("train " + nvme_args() + "--steps 1");
  expect_one_line_error(r, "No space left on device");
  EXPECT_EQ(r.out.find("step 1"), std::string::npos) << r.out;
}

// Starts strata in the background, waits for `marker` in its output, sends `sig` (twice when
// `twice`), and returns its exit status and output.
Result run_and_signal(const std::string& args, const fs::path& out, const std::string& marker, int sig, bool twice) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const std::string cmd = "exec " + std::string(STRATA_BIN) + " " + args + " >" + out.string() + " 2>&1";
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  const auto t0 = std::chrono::steady_clock::now();
  int status = 0;
  while (slurp(out).find(marker) == std::string::npos && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60)) {
    if (::waitpid(pid, &status, WNOHANG) == pid) return {-1, slurp(out), ""};  // exited early
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(pid, sig);
  if (twice) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ::kill(pid, sig);
  }
  ::waitpid(pid, &status, 0);
  Result r;
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  return r;
}

TEST_F(OffloadCli, SigintAndSigtermStopAfterTheStepAndRemoveSwap) {
  for (int sig : {SIGINT, SIGTERM}) {
    const Result r = run_and_signal("train " + nvme_args() + "--steps 1000 --log-every 1",
                                    dir_ / ("out" + std::to_string(sig) + ".txt"),
                                    "step    1/1000", sig, false);
    EXPECT_EQ(r.status, 128 + sig) << r.out;
    EXPECT_NE(r.out.find(sig == SIGINT ? "stopped by SIGINT after step" : "stopped by SIGTERM after step"),
              std::string::npos)
        << r.out;
    EXPECT_TRUE(fs::is_empty(swap())) << "swap files left behind";
  }
}

TEST_F(OffloadCli, SecondSigintStopsAtOnceAndRemovesSwap) {
  const Result r = run_and_signal("train " + nvme_args() + "--steps 1000 --log-every 1", dir_ / "out.txt",
                                  "step    1/1000", SIGINT, true);
  EXPECT_EQ(r.status, 130) << r.out;
  EXPECT_TRUE(fs::is_empty(swap())) << "swap files left behind";
}

// A run killed with SIGKILL cannot clean up; the next run on the same --nvme-path removes what it
// left (and only that).
TEST_F(OffloadCli, LeftoversOfAKilledRunAreRemovedByTheNext) {
  const Result killed = run_and_signal("train " + nvme_args() + "--steps 1000 --log-every 1", dir_ / "out.txt",
                                       "step    1/1000", SIGKILL, false);
  EXPECT_FALSE(fs::is_empty(swap()));
  fs::create_directories(swap() / "users-own");
  const Result r = run("train " + nvme_args() + "--steps 1");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("left by a run"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::exists(swap() / "users-own"));
  EXPECT_EQ(std::distance(fs::directory_iterator(swap()), fs::directory_iterator{}), 1);
}

// `strata bench offload` validates its inputs before touching the disk: --steps 0 divided by
// zero (SIGFPE), --compute-ms inf spun forever, and a huge --units x --unit-size spun in the swap
// allocator; each is now a one-line error, within seconds.
TEST_F(OffloadCli, BenchOffloadRefusesBadInputsQuickly) {
  const std::string bench = "timeout 60 " + std::string(STRATA_BIN) + " bench offload --nvme-path " + swap().string();
  for (const char* args : {"--units 8 --unit-size 1M --steps 0", "--units 8 --unit-size 1M --compute-ms inf",
                                 "--units 8 --unit-size 1M --compute-ms nan", "--units 1000000 --unit-size 1T",
                                 "--units 8 --unit-size 0", "--units 8 --host-units 0 --unit-size 1M"}) {
    const fs::path e = dir_ / "stderr";
    const int rc = std::system((bench + " " + args + " >/dev/null 2>" + e.string()).c_str());
    ASSERT_TRUE(WIFEXITED(rc)) << args << ": killed by a signal";
    const int status = WEXITSTATUS(rc);
    EXPECT_NE(status, 0) << args;
    EXPECT_NE(status, 124) << args << ": timed out";
    const std::string err = slurp(e);
    EXPECT_NE(err.find("bench offload"), std::string::npos) << args << ": " << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << args << ": " << err;
  }
  EXPECT_TRUE(fs::is_empty(swap()));
}

// `strata plan` names the norm barrier where clipping makes the update wait for every gradient
// (a 1 MB/s disk: the window's I/O dwarfs its compute), and not with --grad-clip 0, where each
// unit updates in the backward; --json carries the bound only where it applies.
TEST_F(OffloadCli, PlanNamesTheNormBarrierOnlyWhereClippingWaits) {
  const std::string plan = "plan " + nvme_args() + "--probe-seconds 0.01 --nvme-bw 0.001 ";
  Result r = run(plan);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("norm barrier: no schedule runs this step in under"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("AdamW in the next step's forward"), std::string::npos) << r.out;
  r = run(plan + "--grad-clip 0");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out.find("norm barrier"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("AdamW in the backward"), std::string::npos) << r.out;
  r = run(plan + "--json");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("\"barrier_step_ms\":"), std::string::npos) << r.out;
  r = run(plan + "--json --grad-clip 0");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out.find("barrier_"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"update_in_backward\":true"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::is_empty(swap()));
}

// --speculate auto: a trial whose verdict is to wait (forced: trial-verdicts:0) runs again 128
// steps later, as how often the norm clips changes over a run, then 256 after the next verdict
// to wait (doubling: where every step clips, the trials' rollbacks stay cheap); the progress
// line says each verdict whatever --log-every, and the run is bitwise the one that never
// speculates.
TEST_F(OffloadCli, SpeculateAutoTriesAgainAfterAVerdictToWait) {
  const std::string args = "train --model " + (dir_ / "tiny").string() +
                           " --threads 1 --seq 16 --batch 1 --steps 400 --log-every 1000 --offload-optimizer nvme "
                           "--nvme-path " + swap().string() + " --metrics ";
  Result r = run(args + (dir_ / "auto.jsonl").string() + " --speculate auto --speculate-trial 2",
                 "STRATA_FAULT=trial-verdicts:0");
  ASSERT_EQ(r.status, 0) << r.err;
  std::vector<int64_t> speculated;
  for (const auto& j : strata::test::read_metrics(dir_ / "auto.jsonl"))
    if (j["speculated"].get<bool>()) speculated.push_back(j["step"].get<int64_t>());
  // Trial at steps 1-2 (speculating) and 3-4 (waiting), a verdict to wait, then again from 133
  // (verdict at 136) and from 393.
  EXPECT_EQ(speculated, (std::vector<int64_t>{1, 2, 133, 134, 393, 394}));
  size_t verdicts = 0;
  for (size_t at = r.out.find("waits for the norm from now on"); at != std::string::npos;
       at = r.out.find("waits for the norm from now on", at + 1))
    ++verdicts;
  EXPECT_EQ(verdicts, 3u) << r.out;
  EXPECT_NE(r.out.find("step   4/400"), std::string::npos) << r.out;
  r = run(args + (dir_ / "off.jsonl").string() + " --speculate off");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(strata::test::exact_metrics(dir_ / "auto.jsonl"), strata::test::exact_metrics(dir_ / "off.jsonl"));
  EXPECT_TRUE(fs::is_empty(swap()));
}

// --speculate auto with every step clipping and a verdict to speculate (forced:
// trial-verdicts:1): the trial's rollbacks (steps 1-3) leave no backoff behind, so from step 7
// the backoff starts afresh: speculate, wait 1, speculate, wait 2, speculate, wait 4, ...
TEST_F(OffloadCli, SpeculateAutoBacksOffAfreshAfterAVerdictToSpeculate) {
  const Result r = run("train --model " + (dir_ / "tiny").string() +
                           " --threads 1 --seq 16 --batch 1 --steps 17 --grad-clip 1e-6 --offload-optimizer nvme "
                           "--nvme-path " + swap().string() + " --speculate auto --speculate-trial 3 --metrics " +
                           (dir_ / "m.jsonl").string(),
                       "STRATA_FAULT=trial-verdicts:1");
  ASSERT_EQ(r.status, 0) << r.err;
  std::vector<int64_t> speculated, rolled;
  for (const auto& j : strata::test::read_metrics(dir_ / "m.jsonl")) {
    if (j["speculated"].get<bool>()) speculated.push_back(j["step"].get<int64_t>());
    if (j["rolled_back"].get<bool>()) rolled.push_back(j["step"].get<int64_t>());
  }
  EXPECT_EQ(speculated, (std::vector<int64_t>{1, 2, 3, 7, 9, 12, 17}));
  EXPECT_EQ(rolled, speculated);  // (a clip of 1e-6 binds on every step)
  EXPECT_NE(r.out.find("speculates from now on"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::is_empty(swap()));
}

// `strata bench io --mode rw`: half the blocks written and half read, in flight together (the
// traffic of an offloaded step); every byte of --size is moved once, and the swap file is freed.
TEST_F(OffloadCli, BenchIoMixedModeMovesEveryByteOnce) {
  const Result r = run("bench io --path " + swap().string() + " --size 8M --block 1M --qd 4 --mode rw --allow-buffered-io");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("\"mode\":\"rw\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"size_bytes\":8388608"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"mb_per_s\":"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::is_empty(swap()));
  const Result bad = run("bench io --path " + swap().string() + " --size 8M --mode readwrite");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.err.find("rw"), std::string::npos) << bad.err;
}

}  // namespace
