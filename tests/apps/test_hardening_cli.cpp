// Nothing lost when runs share a machine, a directory or a launcher (issue "hardening"): each
// case as a user would meet it, through the built binary. --metrics never writes over an input
// or a non-metrics file; --checkpoint-dir and --out are locked for the life of a run; a fresh run
// never touches another run's checkpoints; --resume auto never restarts silently; a shard that
// shrinks, SIGPIPE, SIGHUP, SIGUSR1, a double SIGTERM during a save, a FIFO, unreadable weights
// and bad values each end cleanly with a message naming the thing.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "src/data/token_shards.h"
#include "tests/apps/cli_test_util.h"

namespace fs = std::filesystem;
using strata::test::CliResult;
using strata::test::slurp;

namespace {

// A process started in the background (its own process group), stdout and stderr to files.
struct Background {
  pid_t pid = -1;
  fs::path out, err;
  // Waits for it; its exit status, or 128 + the signal that killed it.
  int wait() {
    int st = 0;
    if (::waitpid(pid, &st, 0) != pid) return -1;
    pid = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  }
  ~Background() {
    if (pid > 0) {
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

class HardeningCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = strata::test::make_scratch_dir("strata_hardening");
    ASSERT_FALSE(dir_.empty());
    strata::test::write_tiny_llama(dir_ / "tiny", 64, 2, 128);
  }
  void TearDown() override { fs::remove_all(dir_); }
  CliResult run(const std::string& args) { return strata::test::run_strata(dir_, args); }
  std::string tiny(int steps) const {
    return "train --model " + (dir_ / "tiny").string() + " --threads 1 --batch 2 --seq 16 --warmup 1 --steps " +
           std::to_string(steps) + " ";
  }
  // `strata ARGS` in the background, in a process group of its own (as a shell job).
  Background start(const std::string& args, const std::string& tag, bool ignore_hup = false) {
    Background b;
    b.out = dir_ / (tag + ".stdout");
    b.err = dir_ / (tag + ".stderr");
    const std::string cmd = "exec " + std::string(STRATA_BIN) + " " + args + " >" + b.out.string() + " 2>" +
                            b.err.string();
    b.pid = ::fork();
    if (b.pid == 0) {
      ::setpgid(0, 0);
      if (ignore_hup) ::signal(SIGHUP, SIG_IGN);  // as nohup starts it
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    return b;
  }
  // Waits until `file` holds `text` (or `seconds` pass).
  static bool wait_for(const fs::path& file, const std::string& text, double seconds = 60) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < end) {
      if (slurp(file).find(text) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  static std::vector<std::string> names_in(const fs::path& d) {
    std::vector<std::string> v;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(d, ec)) v.push_back(e.path().filename().string());
    std::sort(v.begin(), v.end());
    return v;
  }
  static std::string exact_lines(const fs::path& metrics) {
    std::string rows;
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      rows += j["step"].dump() + " " + j["loss"].dump() + " " + j["grad_norm"].dump() + "\n";
    }
    return rows;
  }
  fs::path dir_;
};

// 1. --metrics never writes over a file the run reads, nor over anything but a metrics file;
// --out is never the input model unless --overwrite-model says so.
TEST_F(HardeningCli, MetricsAndOutNeverWriteOverInputs) {
  const fs::path model = dir_ / "model", data = dir_ / "shard.bin";
  ASSERT_EQ(run(tiny(1) + "--out " + model.string()).status, 0);
  std::vector<uint32_t> tokens(4000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i % 256);
  strata::write_token_shard(data, tokens, 1);
  const std::string weights = slurp(model / "model.safetensors"), shard = slurp(data);
  const std::string base = "train --model " + model.string() + " --threads 1 --batch 2 --seq 16 --steps 1 ";

  CliResult r = run(base + "--metrics " + (model / "model.safetensors").string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("which this run reads"), std::string::npos) << r.err;
  r = run(base + "--data " + data.string() + " --metrics " + data.string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("which this run reads"), std::string::npos) << r.err;
  // A symlink to an input is the input.
  fs::create_symlink(data, dir_ / "link.jsonl");
  r = run(base + "--data " + data.string() + " --metrics " + (dir_ / "link.jsonl").string());
  EXPECT_NE(r.status, 0) << r.out;
  EXPECT_EQ(slurp(model / "model.safetensors"), weights);
  EXPECT_EQ(slurp(data), shard);

  // A file inside the checkpoint being resumed.
  const fs::path ck = dir_ / "ck";
  ASSERT_EQ(run(tiny(2) + "--checkpoint-dir " + ck.string()).status, 0);
  const fs::path manifest = ck / "step-00000002" / "trainer.json";
  const std::string before = slurp(manifest);
  r = run(tiny(4) + "--checkpoint-dir " + ck.string() + " --resume auto --metrics " + manifest.string());
  EXPECT_NE(r.status, 0);
  EXPECT_EQ(slurp(manifest), before);

  // Anything that is not a metrics file is refused, untouched; a metrics file is appended to.
  std::ofstream(dir_ / "notes.txt") << "my notes\n";
  r = run(tiny(1) + "--metrics " + (dir_ / "notes.txt").string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("not a strata metrics file"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(dir_ / "notes.txt"), "my notes\n");
  r = run(tiny(1) + "--metrics " + dir_.string());
  EXPECT_NE(r.status, 0);
  const fs::path m = dir_ / "m.jsonl";
  ASSERT_EQ(run(tiny(2) + "--metrics " + m.string()).status, 0);
  ASSERT_EQ(run(tiny(3) + "--metrics " + m.string()).status, 0);
  std::ifstream in(m);
  int lines = 0;
  for (std::string line; std::getline(in, line);) ++lines;
  EXPECT_EQ(lines, 5);

  // --out equal to --model.
  r = run(base + "--out " + model.string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--overwrite-model"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(model / "model.safetensors"), weights);
  r = run(base + "--out " + model.string() + " --overwrite-model");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(slurp(model / "model.safetensors"), weights);
}

// What the rules must not refuse: a metrics file and the final model beside the checkpoints,
// a stream as --metrics, a run started under nohup; and a resumed run cuts only its own stale
// metrics lines.
TEST_F(HardeningCli, HarmlessLayoutsStreamsAndNohupAreAccepted) {
  const fs::path ck = dir_ / "ck";
  CliResult r = run(tiny(2) + "--checkpoint-dir " + ck.string() + " --metrics " + (ck / "metrics.jsonl").string() +
                    " --out " + (ck / "final").string());
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::exists(ck / "final" / "model.safetensors"));
  r = run(tiny(1) + "--metrics /dev/stdout");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("\"step\":1"), std::string::npos) << r.out;

  Background h = start(tiny(100000), "nohup", /*ignore_hup=*/true);
  ASSERT_TRUE(wait_for(h.out, " 1/100000")) << slurp(h.err);
  ::kill(h.pid, SIGHUP);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ::kill(h.pid, SIGTERM);
  EXPECT_EQ(h.wait(), 128 + SIGTERM) << slurp(h.out);
  EXPECT_EQ(slurp(h.out).find("SIGHUP"), std::string::npos);

  // Run B is "killed" after step 6 with its last checkpoint at 4; run A appends to the same file.
  const fs::path m = dir_ / "m.jsonl", b = dir_ / "b";
  ASSERT_EQ(run(tiny(6) + "--seed 2 --checkpoint-dir " + b.string() + " --checkpoint-every 4 --keep 3 --metrics " +
                m.string())
                .status,
            0);
  fs::remove_all(b / "step-00000006");
  std::ofstream(b / "latest") << "step-00000004\n";
  ASSERT_EQ(run(tiny(3) + "--seed 1 --metrics " + m.string()).status, 0);
  ASSERT_EQ(run(tiny(7) + "--seed 2 --checkpoint-dir " + b.string() + " --resume auto --metrics " + m.string()).status, 0);
  std::vector<int64_t> steps;
  std::ifstream in(m);
  for (std::string line; std::getline(in, line);) steps.push_back(nlohmann::json::parse(line)["step"].get<int64_t>());
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 1, 2, 3, 5, 6, 7}));
  // With nothing after them, its stale lines are cut.
  fs::remove_all(b / "step-00000007");
  std::ofstream(b / "latest") << "step-00000004\n";
  ASSERT_EQ(run(tiny(5) + "--seed 2 --checkpoint-dir " + b.string() + " --resume auto --metrics " + m.string()).status, 0);
  steps.clear();
  std::ifstream again(m);
  for (std::string line; std::getline(again, line);) steps.push_back(nlohmann::json::parse(line)["step"].get<int64_t>());
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 1, 2, 3, 5}));
  // A last line a killed writer left unfinished is cut before a fresh run appends.
  std::ofstream(m, std::ios::app) << "{\"step\":9,\"lo";
  ASSERT_EQ(run(tiny(1) + "--metrics " + m.string()).status, 0);
  steps.clear();
  std::ifstream third(m);
  for (std::string line; std::getline(third, line);) steps.push_back(nlohmann::json::parse(line)["step"].get<int64_t>());
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 1, 2, 3, 5, 1}));
}

// 2. A second run into a --checkpoint-dir or an --out in use is refused, naming the holder.
TEST_F(HardeningCli, ASecondRunIntoTheSameDirectoriesIsRefused) {
  const fs::path ck = dir_ / "ck", out = dir_ / "out";
  Background a = start(tiny(100000) + "--checkpoint-dir " + ck.string() + " --out " + out.string(), "a");
  ASSERT_TRUE(wait_for(a.out, " 1/100000")) << slurp(a.err);
  CliResult r = run(tiny(3) + "--seed 2 --checkpoint-dir " + ck.string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("in use by another strata run (pid " + std::to_string(a.pid) + ")"), std::string::npos) << r.err;
  r = run(tiny(3) + "--seed 2 --out " + out.string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--out " + out.string() + " is in use"), std::string::npos) << r.err;
  // One run's --checkpoint-dir is another's --out (spelled through a symlink): the same lock.
  fs::create_directory_symlink(ck, dir_ / "ck-link");
  r = run(tiny(3) + "--seed 2 --out " + (dir_ / "ck-link").string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("is in use by another strata run"), std::string::npos) << r.err;
  ::kill(a.pid, SIGTERM);
  EXPECT_EQ(a.wait(), 128 + SIGTERM);
  // Released with the run (kill -9 included: the kernel drops the lock).
  Background b = start(tiny(100000) + "--checkpoint-dir " + (dir_ / "ck2").string(), "b");
  ASSERT_TRUE(wait_for(b.out, " 1/100000")) << slurp(b.err);
  ::kill(b.pid, SIGKILL);
  b.wait();
  EXPECT_EQ(run(tiny(2) + "--checkpoint-dir " + (dir_ / "ck2").string() + " --resume auto").status, 0);
}

// 3. A fresh run never writes into, or rotates away, another run's checkpoints.
TEST_F(HardeningCli, AFreshRunNeverTouchesAnotherRunsCheckpoints) {
  const fs::path ck = dir_ / "ck";
  ASSERT_EQ(run(tiny(6) + "--seed 3 --checkpoint-dir " + ck.string() + " --checkpoint-every 3").status, 0);
  const auto before = names_in(ck);
  CliResult r = run(tiny(8) + "--seed 4 --keep 2 --checkpoint-dir " + ck.string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("holds checkpoints of another run (step-00000003, step-00000006)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--resume auto"), std::string::npos) << r.err;
  EXPECT_EQ(names_in(ck), before);
  // Continuing it is fine, and its rotation keeps a checkpoint of no known run (written before
  // run ids) while removing its own.
  auto man = nlohmann::json::parse(slurp(ck / "step-00000003" / "trainer.json"));
  man.erase("run_id");
  std::ofstream(ck / "step-00000003" / "trainer.json") << man.dump(2);
  r = run(tiny(10) + "--seed 3 --keep 1 --checkpoint-dir " + ck.string() + " --checkpoint-every 2 --resume auto");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(names_in(ck), (std::vector<std::string>{"latest", "step-00000003", "step-00000010"}));
}

// 4. --resume auto starts fresh only in a directory with no checkpoint at all.
TEST_F(HardeningCli, ResumeAutoNeverRestartsSilently) {
  const fs::path ck = dir_ / "ck";
  EXPECT_EQ(run(tiny(3) + "--checkpoint-dir " + ck.string() + " --resume auto --checkpoint-every 1 --keep 5").status, 0);
  // `latest` garbage: an error naming it and the newest complete checkpoint.
  std::ofstream(ck / "latest") << "\x01garbage";
  CliResult r = run(tiny(5) + "--checkpoint-dir " + ck.string() + " --resume auto");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("latest names no checkpoint"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--resume " + (ck / "step-00000003").string()), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("step 1/"), std::string::npos);
  // `latest` naming a checkpoint without trainer.json: its older one is the way out.
  std::ofstream(ck / "latest") << "step-00000003\n";
  fs::remove(ck / "step-00000003" / "trainer.json");
  r = run(tiny(5) + "--checkpoint-dir " + ck.string() + " --resume auto");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--resume " + (ck / "step-00000002").string()), std::string::npos) << r.err;
  // A corrupt file in the newest: named, with the older one.
  std::ofstream(ck / "latest") << "step-00000002\n";
  {
    std::fstream f(ck / "step-00000002" / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-4, std::ios::end);
    f.write("\xde\xad\xbe\xef", 4);
  }
  r = run(tiny(5) + "--checkpoint-dir " + ck.string() + " --resume auto");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("checksum mismatch"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--resume " + (ck / "step-00000001").string()), std::string::npos) << r.err;
  // The only checkpoint lacks trainer.json: an error, no fresh start.
  const fs::path ck2 = dir_ / "ck2";
  ASSERT_EQ(run(tiny(2) + "--checkpoint-dir " + ck2.string()).status, 0);
  fs::remove(ck2 / "step-00000002" / "trainer.json");
  fs::remove(ck2 / "latest");
  r = run(tiny(4) + "--checkpoint-dir " + ck2.string() + " --resume auto");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("step-00000002 is not a complete checkpoint"), std::string::npos) << r.err;
}

// 7. A shard that shrinks under a running job is an error naming it; swap files are removed.
TEST_F(HardeningCli, AShardTruncatedUnderARunIsAnErrorNamingIt) {
  const fs::path data = dir_ / "shard.bin", swap = dir_ / "swap";
  fs::create_directories(swap);
  std::vector<uint32_t> tokens(200000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>((i * 7) % 256);
  strata::write_token_shard(data, tokens, 1);
  Background a = start(tiny(100000) + "--data " + data.string() +
                           " --offload-optimizer nvme --nvme-path " + swap.string(),
                       "a");
  ASSERT_TRUE(wait_for(a.out, " 2/100000")) << slurp(a.err);
  ASSERT_EQ(::truncate(data.c_str(), 1024 + 2 * 600), 0);
  const int rc = a.wait();
  EXPECT_EQ(rc, 1) << slurp(a.err);
  EXPECT_NE(slurp(a.err).find(data.string() + ": the token shard shrank"), std::string::npos) << slurp(a.err);
  EXPECT_TRUE(names_in(swap).empty());
}

// 8. SIGPIPE (`| head`), SIGHUP and SIGUSR1 never lose the run.
TEST_F(HardeningCli, PipeHangupAndUsr1KeepTheRun) {
  const fs::path ck = dir_ / "ck", swap = dir_ / "swap";
  fs::create_directories(swap);
  // (2000 steps: a run that missed the closed pipe ends, with status 0, instead of hanging the test)
  const std::string cmd = "bash -o pipefail -c '" + std::string(STRATA_BIN) + " " + tiny(2000) +
                          "--checkpoint-dir " + ck.string() + " --offload-optimizer nvme --nvme-path " + swap.string() +
                          " 2>" + (dir_ / "pipe.err").string() + " | sed -n /[[:space:]]2.2000/q'";
  const int rc = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(rc));
  EXPECT_EQ(WEXITSTATUS(rc), 128 + SIGPIPE) << slurp(dir_ / "pipe.err");
  EXPECT_NE(slurp(dir_ / "pipe.err").find("cannot write to stdout"), std::string::npos);
  EXPECT_TRUE(fs::exists(ck / "latest"));
  EXPECT_TRUE(names_in(swap).empty());

  Background h = start(tiny(100000) + "--checkpoint-dir " + ck.string() + " --resume auto", "h");
  ASSERT_TRUE(wait_for(h.out, "step ")) << slurp(h.err);
  ::kill(h.pid, SIGUSR1);
  ASSERT_TRUE(wait_for(h.out, "(asked by SIGUSR1)")) << slurp(h.err);
  ::kill(h.pid, SIGHUP);
  EXPECT_EQ(h.wait(), 128 + SIGHUP);
  EXPECT_NE(slurp(h.out).find("stopped by SIGHUP"), std::string::npos) << slurp(h.out);
}

// 9. Two SIGTERMs 30-50 ms apart during a checkpoint or the final save leave no temporary
// directory behind.
TEST_F(HardeningCli, ADoubleSigtermDuringASaveLeavesNoTemporaryDirectory) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 3; ++trial) {
    const std::string n = std::to_string(trial);
    const fs::path ck = dir_ / "ck" / n, out = dir_ / "out" / n;
    // The embedded default model: about 290 MB a checkpoint, long enough to land in.
    Background a = start("train --threads 1 --batch 1 --seq 16 --steps 100000 --checkpoint-dir " + ck.string() +
                             " --checkpoint-every 1 --out " + out.string(),
                         "a" + n);
    ASSERT_TRUE(wait_for(a.out, "checkpoint ", 120)) << slurp(a.err);
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 200)(rng)));
    ::kill(a.pid, SIGTERM);
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(30, 50)(rng)));
    ::kill(a.pid, SIGTERM);
    EXPECT_EQ(a.wait(), 128 + SIGTERM);
    for (const std::string& name : names_in(ck)) EXPECT_NE(name.rfind(".tmp-", 0), 0u) << name;
    for (const std::string& name : names_in(dir_ / "out")) EXPECT_EQ(name.find(".tmp-"), std::string::npos) << name;
    fs::remove_all(ck);  // about 600 MB a trial
    fs::remove_all(out);
  }
}

// 10, 12, 13: unreadable weights, --out as the checkpoint directory, FIFOs.
TEST_F(HardeningCli, UnreadableInputsAreRefusedBeforeTraining) {
  fs::create_directories(dir_ / "pt");
  fs::copy_file(dir_ / "tiny" / "config.json", dir_ / "pt" / "config.json");
  std::ofstream(dir_ / "pt" / "pytorch_model.bin") << "pickle";
  CliResult r = run("train --model " + (dir_ / "pt").string() + " --steps 1");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("pytorch_model.bin, a format strata does not read"), std::string::npos) << r.err;

  fs::create_directories(dir_ / "dup");
  std::ofstream(dir_ / "dup" / "config.json") << R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "num_hidden_layers": 3,
    "max_position_embeddings": 64})";
  r = run("train --model " + (dir_ / "dup").string() + " --steps 1");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("the key \"num_hidden_layers\" is given twice"), std::string::npos) << r.err;

  r = run(tiny(2) + "--checkpoint-dir " + (dir_ / "ck").string() + " --out " + (dir_ / "ck").string());
  EXPECT_NE(r.status, 0);
  EXPECT_EQ(r.out.find("step 1/"), std::string::npos);
  EXPECT_NE(r.err.find("is also the --checkpoint-dir"), std::string::npos) << r.err;
  // Swap files inside --out: the save at the end would refuse the directory, after the whole run.
  fs::create_directories(dir_ / "x");
  r = run(tiny(2) + "--offload-optimizer nvme --nvme-path " + (dir_ / "x").string() + " --out " + (dir_ / "x").string());
  EXPECT_NE(r.status, 0);
  EXPECT_EQ(r.out.find("step 1/"), std::string::npos);
  EXPECT_NE(r.err.find("--nvme-path " + (dir_ / "x").string() + " is --out"), std::string::npos) << r.err;

  ASSERT_EQ(::mkfifo((dir_ / "fifo").c_str(), 0644), 0);
  fs::create_directories(dir_ / "fm");
  ASSERT_EQ(::mkfifo((dir_ / "fm" / "config.json").c_str(), 0644), 0);
  for (const std::string& args : {"train --model " + (dir_ / "fm").string() + " --steps 1",
                                  tiny(1) + "--data " + (dir_ / "fifo").string(),
                                  "inspect " + (dir_ / "fifo").string()}) {
    r = strata::test::run_strata(dir_, args);
    EXPECT_NE(r.status, 0) << args;
    EXPECT_NE(r.err.find("FIFO"), std::string::npos) << args << ": " << r.err;
  }
}

// 14, 15: values and messages.
TEST_F(HardeningCli, BadValuesAreRefusedNamingTheFix) {
  struct Case {
    std::string args, says;
  };
  const std::vector<Case> cases = {
      {tiny(1) + "--seed -1", "not a whole number from 0 to 18446744073709551615"},
      {tiny(1) + "--seed 18446744073709551616", "not a whole number"},
      {tiny(1) + "--min-lr 0.1 --lr 0.01", "--min-lr 0.1 is above --lr 0.01"},
      {tiny(1) + "--device-mem 12", "12 bytes: did you mean 12G?"},
      {tiny(1) + "--grad-clip 1e308", "a number in [0, 1e30]"},
      {tiny(1) + "--keep 3", "give --checkpoint-dir DIR too"},
      {"train --model " + (dir_ / "absent").string() + " --steps 1", "does not exist"},
  };
  for (const Case& c : cases) {
    const CliResult r = run(c.args);
    EXPECT_NE(r.status, 0) << c.args;
    EXPECT_NE(r.err.find(c.says), std::string::npos) << c.args << ": " << r.err;
  }
  fs::create_symlink(dir_ / "loop", dir_ / "loop");
  const CliResult r = run("train --model " + (dir_ / "loop").string() + " --steps 1");
  EXPECT_NE(r.err.find("a loop of symbolic links"), std::string::npos) << r.err;
  // The default --min-lr above a small --lr: a warning, not an error.
  const CliResult w = run(tiny(1) + "--lr 1e-5");
  EXPECT_EQ(w.status, 0);
  EXPECT_NE(w.err.find("the default --min-lr"), std::string::npos) << w.err;
}

// 14: a checkpoint's loss scale and 15: its data position are checked on resume.
TEST_F(HardeningCli, ResumeChecksTheCheckpointsStateAndData) {
  const fs::path ck = dir_ / "ck";
  std::vector<uint32_t> tokens(3000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i % 256);
  strata::write_token_shard(dir_ / "a.bin", tokens, 1);
  strata::write_token_shard(dir_ / "b.bin", tokens, 1);
  // 100 steps of 32 tokens: the checkpoint is in the second shard.
  ASSERT_EQ(run(tiny(100) + "--data '" + (dir_ / "*.bin").string() + "' --checkpoint-dir " + ck.string()).status, 0);
  CliResult r = run(tiny(110) + "--data " + (dir_ / "a.bin").string() + " --checkpoint-dir " + ck.string() +
                    " --resume auto");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("resume with the --data the checkpoint was trained on"), std::string::npos) << r.err;
  const fs::path manifest = ck / "step-00000100" / "trainer.json";
  const auto good = nlohmann::json::parse(slurp(manifest));
  for (const double scale : {-1.0, 0.0, 3.0, 1e300}) {
    auto bad = good;
    bad["loss_scaler"]["scale"] = scale;
    std::ofstream(manifest) << bad.dump(2);
    r = run(tiny(110) + "--data '" + (dir_ / "*.bin").string() + "' --checkpoint-dir " + ck.string() + " --resume auto");
    EXPECT_NE(r.status, 0) << scale;
    EXPECT_NE(r.err.find("loss_scaler.scale"), std::string::npos) << r.err;
  }
}

// The header's flags line runs as it is.
TEST_F(HardeningCli, TheHeadersFlagsLineIsCopyPasteable) {
  const CliResult r = run(tiny(1) + "--checkpoint-activations every:2 --metrics '" + (dir_ / "a b.jsonl").string() + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const size_t at = r.out.find("  flags      ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string flags = r.out.substr(at + 12, r.out.find('\n', at) - at - 12);
  std::string quoted = "'";
  quoted += (dir_ / "a b.jsonl").string();
  quoted += "'";
  EXPECT_NE(flags.find(quoted), std::string::npos) << flags;
  std::string args = "train";
  args += flags;
  const CliResult again = strata::test::run_strata(dir_, args);
  EXPECT_EQ(again.status, 0) << flags << "\n" << again.err;
}

}  // namespace
