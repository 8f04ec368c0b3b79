// The command line's error messages, through the built binary: each names the flag or command
// at fault and the fix, on one line, and is raised before any work starts (plan's NVMe probe sized
// to the disk it runs on; out-of-range plan and bench flags; a budget error that names what fills
// memory; inspect of a FIFO or device; a mistyped command; a flag given twice).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "kernels/runtime.h"
#include "tests/apps/cli_test_util.h"

namespace fs = std::filesystem;

namespace {

using strata::test::CliResult;

class MessagesCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = strata::test::make_scratch_dir("strata_msgs");
    ASSERT_FALSE(dir_.empty());
    fs::create_directories(swap());
    // A small llama (4 blocks of 128): every plan and step is quick.
    strata::test::write_tiny_llama(dir_ / "tiny", 128, 4, 256);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path swap() const { return dir_ / "swap"; }
  std::string tiny() const { return "--model " + (dir_ / "tiny").string() + " --threads 1 "; }
  // A plan that moves state to and from NVMe every step (so it probes the disk unless --nvme-bw).
  std::string nvme_plan() const {
    return "plan " + tiny() + "--seq 32 --host-mem 3M --offload-optimizer nvme --offload-grads nvme --offload-params nvme "
           "--nvme-path " + swap().string() + " --probe-seconds 0.01";
  }
  CliResult run(const std::string& args) { return strata::test::run_strata(dir_, args); }
  // `strata ARGS` after `prefix` in a shell (ulimit, a mount in a private namespace), at most 60 s.
  CliResult run_in_shell(const std::string& prefix, const std::string& args) {
    const fs::path o = dir_ / "stdout", e = dir_ / "stderr";
    const std::string inner = prefix + " && exec timeout 60 " + std::string(STRATA_BIN) + " " + args;
    const std::string cmd = "sh -c \"" + inner + "\" >" + o.string() + " 2>" + e.string();
    const int rc = std::system(cmd.c_str());
    return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, strata::test::slurp(o), strata::test::slurp(e)};
  }
  // Whether a tmpfs can be mounted on swap() in a private user and mount namespace (not where
  // unprivileged user namespaces are off).
  bool can_mount_tmpfs() {
    return std::system(("unshare -rm sh -c 'mount -t tmpfs -o size=1m none " + swap().string() + "' 2>/dev/null")
                           .c_str()) == 0;
  }
  // One line on stderr, non-zero exit, naming `what`.
  static void expect_error(const CliResult& r, const std::string& what) {
    EXPECT_NE(r.status, 0) << r.out;
    EXPECT_NE(r.err.find(what), std::string::npos) << r.err;
    EXPECT_LE(std::count(r.err.begin(), r.err.end(), '\n'), 2) << r.err;  // CLI11 adds "Run with --help"
  }
  fs::path dir_;
};

// A 64 MiB disk: the 512 MiB probe would fail where `train` with the same flags runs; sized to
// half the free space it fits. On 8 MiB it declines, naming the flag that skips it.
TEST_F(MessagesCli, PlanProbeFitsASmallNvmePath) {
  if (!can_mount_tmpfs()) GTEST_SKIP() << "no unprivileged tmpfs mounts here (unshare -rm)";
  const auto on_tmpfs = [&](const std::string& size) {
    const fs::path o = dir_ / "stdout", e = dir_ / "stderr";
    const std::string cmd = "unshare -rm sh -c 'mount -t tmpfs -o size=" + size + " none " + swap().string() +
                            " && exec timeout 60 " + std::string(STRATA_BIN) + " " + nvme_plan() + "' >" +
                            o.string() + " 2>" + e.string();
    const int rc = std::system(cmd.c_str());
    return CliResult{WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, strata::test::slurp(o), strata::test::slurp(e)};
  };
  CliResult r = on_tmpfs("64m");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("predicted step"), std::string::npos) << r.out;
  r = on_tmpfs("8m");
  expect_error(r, "cannot probe the NVMe bandwidth");
  EXPECT_NE(r.err.find("--nvme-bw"), std::string::npos) << r.err;
}

// The probe failing (here: a file size limit) says it was the probe, and how to skip it.
TEST_F(MessagesCli, PlanProbeFailureNamesTheProbe) {
  const CliResult r = run_in_shell("ulimit -f 4096; trap '' XFSZ", nvme_plan());
  expect_error(r, "NVMe bandwidth probe");
  EXPECT_NE(r.err.find("give --nvme-bw GB/s to skip the probe"), std::string::npos) << r.err;
}

TEST_F(MessagesCli, PlanRejectsOutOfRangeFlags) {
  const std::string plan = "plan " + tiny() + "--seq 32 --probe-seconds 0.01 ";
  for (const char* bw : {"-1", "nan", "inf", "1e-9", "1e9"}) expect_error(run(plan + "--nvme-bw " + bw), "--nvme-bw");
  for (const char* s : {"0", "-1", "nan", "1e9"})  // in a shell with a timeout: 1e9 s of probing never ended
    expect_error(run_in_shell("true", "plan " + tiny() + "--seq 32 --probe-seconds " + s), "--probe-seconds");
  for (const char* w : {"0", "1000000000"}) expect_error(run(plan + "--world " + w), "--world");
  for (const char* f : {"0,1", "1,0", "1.5,1", "0.5", "a,b", "0.5,0.5,0.5", "nan,1", "0.5x,1", ","})
    expect_error(run(plan + "--io-interference " + f), "--io-interference");
  EXPECT_EQ(run(plan + "--nvme-bw 2.5 --world 2 --json").status, 0);  // in range
  for (const char* g : {"0", "-1", "nan", "inf", "2e9"}) expect_error(run(plan + "--probe-gflop " + g), "--probe-gflop");
}

// A modeled GPU's flags: an unknown name, a figure out of range or missing its partners, GPU
// flags on --backend cpu, a model that does not fit the GPU, and (where no GPU is here) --backend
// cuda with nothing to probe or model: each refused naming the flag and the fix.
TEST_F(MessagesCli, PlanRefusesMalformedGpuFlags) {
  const std::string plan = "plan " + tiny() + "--seq 32 --probe-seconds 0.01 ";
  const std::string cuda = plan + "--backend cuda ";
  expect_error(run(cuda + "--gpu h900"), "plan --gpu h900: not a GPU this plan knows; give one of h100|h200|a100-80g");
  for (const char* v : {"0", "-1", "nan", "inf", "1e9"}) {
    expect_error(run(cuda + "--gpu h100 --gpu-tflops " + v), "plan --gpu-tflops");
    expect_error(run(cuda + "--gpu h100 --gpu-mem " + v), "--gpu-mem");
    expect_error(run(cuda + "--gpu h100 --pcie-gbs " + v), "--pcie-gbs");
    expect_error(run(cuda + "--gpu h100 --gpu-hbm-gbs " + v), "--gpu-hbm-gbs");
  }
  expect_error(run(cuda + "--gpu-tflops 100 --gpu-mem 80"), "(missing: --pcie-gbs), or name one with --gpu");
  expect_error(run(cuda + "--gpu-tflops 100 --gpu-mem 80 --pcie-gbs 32"), "give --gpu-hbm-gbs");
  expect_error(run(plan + "--gpu h100"), "plan --gpu h100: models a GPU for --backend cuda");
  expect_error(run(plan + "--gpu-mem 80"), "add --backend cuda");
  expect_error(run(cuda + "--gpu h100 --gpu-mem 0.0001"), "device memory and the modeled h100");
  expect_error(run(cuda + "--gpu rtx4090 --device-mem 30G"), "plan --device-mem 30G: more than the modeled rtx4090 "
                                                            "has (24.00 GiB); give --device-mem 24G or less");
  if (!strata::kernels::cuda_available()) expect_error(run(cuda), "plan --backend cuda: no CUDA device here to probe; name");
  EXPECT_EQ(run(cuda + "--gpu h100").status, 0);
}

// Activations fill the budget: the message says so and points at --batch/--seq and
// checkpointing, not (first) at moving the optimizer state.
TEST_F(MessagesCli, BudgetErrorNamesTheLargestConsumer) {
  CliResult r = run("train " + tiny() + "--batch 64 --seq 64 --device-mem 2M --steps 1");
  expect_error(r, "the largest part of device memory is activations and workspace");
  EXPECT_NE(r.err.find("a smaller --batch or --seq"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--checkpoint-activations full"), std::string::npos) << r.err;
  // A small batch: the optimizer state is the largest, and its flag comes first.
  r = run("train " + tiny() + "--batch 1 --seq 8 --device-mem 1M --steps 1");
  expect_error(r, "the largest part of device memory is the optimizer state");
  EXPECT_NE(r.err.find("move it with --offload-optimizer"), std::string::npos) << r.err;
}

// The case: the default model at --batch 20000 needs ~79 GiB of RAM, nearly all of it
// activations. Skipped where the machine has that much (it would start training).
TEST_F(MessagesCli, HostMemoryErrorNamesActivations) {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kib = 0, avail_kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemAvailable:" || key == "SwapFree:") avail_kib += kib;
    meminfo.ignore(64, '\n');
  }
  if (avail_kib == 0 || avail_kib > (uint64_t{70} << 20)) GTEST_SKIP() << "this machine has 70 GiB or more free";
  const CliResult r = run("train --batch 20000 --seq 15 --steps 1");
  expect_error(r, "the largest part of it is activations and workspace");
  EXPECT_NE(r.err.find("a smaller --batch or --seq"), std::string::npos) << r.err;
}

TEST_F(MessagesCli, BenchOffloadChecksHostUnitsUpFront) {
  const std::string bench = "bench offload --nvme-path " + swap().string() + " --unit-size 1M --units 8 --steps 1 ";
  const CliResult r = run(bench + "--host-units 1");
  expect_error(r, "--host-units 1: give at least 3");
  EXPECT_EQ(r.err.find("--host-mem"), std::string::npos) << r.err;  // a flag bench offload does not have
  EXPECT_TRUE(fs::is_empty(swap()));                                 // nothing measured first
}

TEST_F(MessagesCli, BenchIoNamesTheFlagAtFault) {
  const std::string bench = "bench io --path " + swap().string() + " ";
  expect_error(run(bench + "--size 0"), "--size 0");
  expect_error(run(bench + "--size 4M --block 3K"), "--block 3K");
  const CliResult qd = run(bench + "--size 4M --qd 100000");
  expect_error(qd, "--qd 100000");
  EXPECT_NE(qd.err.find("4096"), std::string::npos) << qd.err;
  const CliResult missing = run("bench io --size 4M --path " + (dir_ / "missing").string());
  expect_error(missing, "the --path directory does not exist");
  EXPECT_EQ(missing.err.find("--nvme-path"), std::string::npos) << missing.err;
}

TEST_F(MessagesCli, BenchStepNamesWarmup) {
  const CliResult r = run("bench step --preset default --batch 1 --seq 8 --steps 1 --warmup -1");
  expect_error(r, "--warmup -1");
}

TEST_F(MessagesCli, BenchOpsChecksNumericFlags) {
  for (const std::string f : {"--reps 0", "--threads -1", "--adamw-params 0", "--peak-gbs -1"}) {
    const CliResult r = run("bench ops " + f);
    expect_error(r, "bench ops " + f + ":");
    EXPECT_LT(r.err.size(), 200u) << r.err;  // no bounds printed as 300-digit doubles
  }
}

// A FIFO is never opened (that would block), a device or a bare directory is named as what it
// is, and the error names `inspect`, not a flag of train.
TEST_F(MessagesCli, InspectNamesWhatItExpects) {
  const fs::path fifo = dir_ / "fifo", bare = dir_ / "bare";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  fs::create_directories(bare);
  for (const fs::path& p : {fifo, bare, fs::path("/dev/zero")}) {
    const CliResult r = run("inspect " + p.string());
    expect_error(r, "inspect " + p.string() + ":");
    EXPECT_NE(r.err.find("expected a model directory"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("--resume"), std::string::npos) << r.err;
  }
  EXPECT_NE(run("inspect " + fifo.string()).err.find("is a FIFO"), std::string::npos);
}

TEST_F(MessagesCli, UnknownCommandSuggestsTheNearest) {
  expect_error(run("trian"), "unknown command 'strata trian': did you mean 'strata train'?");
  expect_error(run("bench opz"), "unknown command 'strata bench opz': did you mean 'strata bench ops'?");
  const CliResult far = run("frobnicate");
  expect_error(far, "unknown command 'strata frobnicate': expected one of");
  EXPECT_NE(far.err.find("train"), std::string::npos) << far.err;
}

TEST_F(MessagesCli, FlagGivenTwice) {
  expect_error(run("train --steps 3 --steps 4"), "--steps given twice (3 and 4): give it once");
  expect_error(run("plan --world 2 --world 3 --world 4"), "--world given 3 times (2, 3 and 4): give it once");
  // A flag meant to repeat still does.
  const CliResult r = run("plan " + tiny() + "--seq 32 --probe-seconds 0.01 --json --nvme-path " + swap().string() +
                          " --nvme-path " + swap().string());
  EXPECT_EQ(r.status, 0) << r.err;
}

}  // namespace
