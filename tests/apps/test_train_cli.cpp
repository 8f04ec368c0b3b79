// `strata train` end to end through the built binary: --help lists every flag with its default,
// bad --seq / unwritable --out are one-line errors with a non-zero exit, the same seed gives the
// same metrics (timing fields aside), and the loss falls on the embedded corpus.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/runtime.h"

namespace fs = std::filesystem;

namespace {

struct Result {
  int status = -1;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

class TrainCli : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string t = (fs::path(::testing::TempDir()) / "strata_cli_XXXXXX").string();
    ASSERT_NE(::mkdtemp(t.data()), nullptr);
    dir_ = t;
    // A tiny byte-level llama (config only: random init from --seed).
    fs::create_directories(dir_ / "tiny");
    std::ofstream(dir_ / "tiny" / "config.json") << R"({
      "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
      "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "intermediate_size": 128, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
      "rope_theta": 10000.0, "tie_word_embeddings": false, "hidden_act": "silu"})";
  }
  void TearDown() override { fs::remove_all(dir_); }
  // env: "NAME=value ..." set for this run only.
  // cwd: the directory strata runs in ("" = the test's).
  Result run(const std::string& args, const std::string& env = "", const fs::path& cwd = "") {
    const fs::path o = dir_ / "stdout", e = dir_ / "stderr";
    const std::string cmd = (cwd.empty() ? "" : "cd '" + cwd.string() + "' && ") + (env.empty() ? "" : "env " + env + " ") +
                            std::string(STRATA_BIN) + " " + args + " >" + o.string() + " 2>" + e.string();
    const int rc = std::system(cmd.c_str());
    return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, slurp(o), slurp(e)};
  }
  std::string tiny() const { return "--model " + (dir_ / "tiny").string() + " --threads 1 "; }
  // A config.json with the tiny model's fields, `field` set to `value` (a JSON literal).
  fs::path config_with(const std::string& field, const std::string& value) {
    nlohmann::json j = nlohmann::json::parse(slurp(dir_ / "tiny" / "config.json"));
    j[field] = nlohmann::json::parse(value);
    const fs::path d = dir_ / ("cfg_" + field);
    fs::create_directories(d);
    std::ofstream(d / "config.json") << j.dump();
    return d;
  }
  // A refusal before training: a clean exit status (not a signal), one line naming `what`, no
  // header printed.
  void expect_refused(const Result& r, const std::string& what, const std::string& context) {
    EXPECT_GT(r.status, 0) << context;
    EXPECT_LT(r.status, 128) << context << " (killed by a signal?)";
    EXPECT_NE(r.err.find(what), std::string::npos) << context << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << context << ": " << r.err;
    EXPECT_EQ(r.out.find("strata train"), std::string::npos) << context << ": header printed";
  }
  fs::path dir_;
};

TEST_F(TrainCli, HelpShowsEveryFlagWithDefault) {
  const Result r = run("train --help");
  EXPECT_EQ(r.status, 0) << r.err;
  for (const char* f : {"--model", "--data", "--backend", "--dtype", "--batch", "--seq", "--grad-accum", "--steps",
                        "--lr ", "--lr-schedule", "--warmup", "--min-lr", "--weight-decay", "--beta1", "--beta2",
                        "--eps", "--grad-clip", "--seed", "--metrics", "--out", "--log-every", "--threads"})
    EXPECT_NE(r.out.find(f), std::string::npos) << f;
  EXPECT_NE(r.out.find("=cosine"), std::string::npos) << r.out;  // defaults are shown
}

TEST_F(TrainCli, SeqBeyondMaxPositionsIsOneLineError) {
  const Result r = run("train " + tiny() + "--seq 129 --steps 1");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("max_position_embeddings"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.out.find("step 1"), std::string::npos);  // nothing trained
}

TEST_F(TrainCli, UnwritableOutIsOneLineError) {
  const Result r = run("train " + tiny() + "--seq 16 --steps 1 --out /proc/strata-test/model");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--out"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.out.find("step 1"), std::string::npos);
}

// Without a GPU (or a CUDA build), --backend cuda stops before the header, in one line.
TEST_F(TrainCli, CudaBackendWithoutAGpuIsRefusedBeforeTraining) {
  if (strata::kernels::cuda_available()) GTEST_SKIP() << "a CUDA device is present: --backend cuda trains here";
  const Result r = run("train " + tiny() + "--seq 16 --steps 1 --backend cuda");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("CUDA"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--backend cpu"), std::string::npos) << r.err;  // the way out
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.out.find("strata train"), std::string::npos) << r.out;  // no header
}

std::vector<nlohmann::json> read_metrics(const fs::path& p) {
  std::vector<nlohmann::json> v;
  std::ifstream f(p);
  for (std::string line; std::getline(f, line);) v.push_back(nlohmann::json::parse(line));
  return v;
}

// Same seed: bitwise-identical metrics except the timing fields; and the metrics schema.
TEST_F(TrainCli, SameSeedSameMetrics) {
  std::vector<std::vector<nlohmann::json>> runs;
  for (int i = 0; i < 2; ++i) {
    std::string name = "m";
    name += std::to_string(i);
    name += ".jsonl";
    const fs::path m = dir_ / name;
    const Result r = run("train " + tiny() + "--batch 2 --seq 32 --steps 4 --grad-accum 2 --seed 5 --metrics " +
                         m.string());
    ASSERT_EQ(r.status, 0) << r.err;
    runs.push_back(read_metrics(m));
  }
  ASSERT_EQ(runs[0].size(), 4u);
  for (size_t s = 0; s < 4; ++s) {
    nlohmann::json a = runs[0][s], b = runs[1][s];
    for (const char* k : {"step", "loss", "grad_norm", "lr", "tokens", "step_ms", "tokens_per_s", "device_bytes",
                          "host_bytes", "nvme_bytes", "bytes_moved"})
      EXPECT_TRUE(a.contains(k)) << k;
    EXPECT_EQ(a["step"], s + 1);
    EXPECT_EQ(a["tokens"], (s + 1) * 2 * 32 * 2);
    for (const char* k : {"step_ms", "tokens_per_s", "compute_ms", "stall_ms", "io_ms", "nvme_busy_ms", "checksum_ms", "peak_rss_bytes", "run_id"})
      a.erase(k), b.erase(k);  // (timings, the process's memory, and each run's own id)
    EXPECT_EQ(a.dump(), b.dump());
  }
  // A different seed gives a different model.
  const fs::path m = dir_ / "m_other.jsonl";
  ASSERT_EQ(run("train " + tiny() + "--batch 2 --seq 32 --steps 1 --grad-accum 2 --seed 6 --metrics " + m.string()).status, 0);
  EXPECT_NE(read_metrics(m)[0]["loss"], runs[0][0]["loss"]);
}

TEST_F(TrainCli, LossFallsOnEmbeddedCorpus) {
  const fs::path m = dir_ / "m.jsonl";
  const Result r = run("train " + tiny() + "--batch 4 --seq 64 --steps 40 --lr 3e-3 --warmup 5 --metrics " +
                       m.string() + " --out " + (dir_ / "out").string());
  ASSERT_EQ(r.status, 0) << r.err;
  const auto v = read_metrics(m);
  ASSERT_EQ(v.size(), 40u);
  const double first = v[0]["loss"], last = v.back()["loss"];
  EXPECT_NEAR(first, std::log(256.0), 0.3);  // a random byte-level model starts near uniform
  EXPECT_LT(last, first - 2.0) << r.out;     // and learns the corpus' structure fast
  EXPECT_TRUE(fs::exists(dir_ / "out" / "config.json"));
  EXPECT_TRUE(fs::exists(dir_ / "out" / "model.safetensors"));
  EXPECT_NE(r.out.find("done: 40 steps"), std::string::npos) << r.out;
}

// STRATA_PROFILE_OPS=1 makes any run print its per-op CPU time table at exit; without it, none.
TEST_F(TrainCli, ProfileOpsPrintsATableAtExit) {
  const std::string args = "train " + tiny() + "--batch 2 --seq 16 --steps 2";
  const Result off = run(args);
  ASSERT_EQ(off.status, 0) << off.err;
  EXPECT_EQ(off.err.find("STRATA_PROFILE_OPS"), std::string::npos) << off.err;
  const Result on = run(args, "STRATA_PROFILE_OPS=1");
  ASSERT_EQ(on.status, 0) << on.err;
  EXPECT_NE(on.err.find("STRATA_PROFILE_OPS: CPU op wall time"), std::string::npos) << on.err;
  for (const char* op : {"matmul", "adamw", "attention_backward", "cross_entropy"})
    EXPECT_NE(on.err.find(op), std::string::npos) << op << " missing from:\n" << on.err;
}

// --out replaces a whole directory, so one holding anything strata did not write is refused
// before training, and so are ".", "..", the working directory (and its parents) and "/".
TEST_F(TrainCli, OutNeverDeletesFilesStrataDidNotWrite) {
  fs::create_directories(dir_ / "v" / "sub");
  std::ofstream(dir_ / "v" / "thesis.txt") << "hi\n";
  const std::string train = "train " + tiny() + "--steps 1 --batch 1 --seq 8 ";
  Result r = run(train + "--out " + (dir_ / "v").string());
  expect_refused(r, "thesis.txt", "--out v");
  EXPECT_NE(r.err.find((dir_ / "v").string()), std::string::npos) << r.err;
  EXPECT_EQ(slurp(dir_ / "v" / "thesis.txt"), "hi\n");
  EXPECT_TRUE(fs::is_directory(dir_ / "v" / "sub"));

  fs::create_directories(dir_ / "work" / "deeper");
  std::ofstream(dir_ / "work" / "notes.txt") << "mine\n";
  for (const std::string& out : {std::string("."), std::string("./"), std::string(".."), (dir_ / "work").string(), (dir_ / "work").string() + "/", std::string("/")}) {
    r = run(train + "--out " + out, "", dir_ / "work");
    expect_refused(r, "--out", "--out " + out);
    r = run(train + "--out " + out, "", dir_ / "work" / "deeper");  // a parent of the working directory
    EXPECT_NE(r.status, 0) << out;
  }
  EXPECT_EQ(slurp(dir_ / "work" / "notes.txt"), "mine\n");

  // What strata wrote itself is replaced: a second run over the same --out succeeds.
  for (int i = 0; i < 2; ++i) {
    r = run(train + "--out " + (dir_ / "model").string());
    ASSERT_EQ(r.status, 0) << r.err;
  }
  EXPECT_TRUE(fs::exists(dir_ / "model" / "model.safetensors"));
}

// --lr 1e3 diverges: the run stops at the first non-finite loss or grad norm, naming the step,
// with a non-zero exit, and leaves an earlier --out as it was (no NaN weights saved).
TEST_F(TrainCli, DivergenceStopsTheRunAndKeepsOut) {
  const fs::path out = dir_ / "model";
  ASSERT_EQ(run("train " + tiny() + "--steps 1 --batch 1 --seq 8 --out " + out.string()).status, 0);
  const std::string before = slurp(out / "model.safetensors");
  const fs::path m = dir_ / "m.jsonl";
  const Result r = run("train " + tiny() + "--lr 1e3 --warmup 0 --steps 20 --batch 1 --seq 8 --out " + out.string() +
                       " --metrics " + m.string());
  EXPECT_GT(r.status, 0);
  EXPECT_LT(r.status, 128);
  EXPECT_NE(r.err.find("diverged"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("step "), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.out.find("saved the model"), std::string::npos) << r.out;
  EXPECT_EQ(slurp(out / "model.safetensors"), before);
  const auto v = read_metrics(m);  // every line whole; the last is the diverged step
  ASSERT_FALSE(v.empty());
  EXPECT_LT(v.size(), 20u);
}

// With the update in the backward (--grad-clip 0) the diverged step has already updated its
// units: the run stops the same way, and no checkpoint of that step is written (the earlier
// ones stay).
TEST_F(TrainCli, DivergenceInTheBackwardUpdateWritesNoCheckpointOfIt) {
  const fs::path ck = dir_ / "ck", m = dir_ / "m.jsonl";
  const Result r = run("train " + tiny() + "--lr 1e3 --warmup 0 --steps 20 --batch 1 --seq 8 --grad-clip 0 " +
                       "--checkpoint-dir " + ck.string() + " --checkpoint-every 1 --keep 100 --metrics " + m.string());
  EXPECT_GT(r.status, 0);
  EXPECT_LT(r.status, 128);
  EXPECT_NE(r.err.find("diverged"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("was not applied"), std::string::npos) << r.err;
  const auto v = read_metrics(m);
  ASSERT_GE(v.size(), 2u) << "diverged at step 1: nothing to keep";
  const int64_t last = v.back().at("step").get<int64_t>();
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(last));
  EXPECT_FALSE(fs::exists(ck / name)) << "the diverged step was checkpointed";
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(last - 1));
  EXPECT_TRUE(fs::exists(ck / name)) << "the step before it was not";
}

// Every numeric flag is validated before the header: no NaN/Inf/negative/absurd value trains,
// and none crashes (SIGFPE from an overflowing B·T was the bug).
TEST_F(TrainCli, BadHyperparametersAreRefusedBeforeTraining) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--lr inf", "--lr"},          {"--lr nan", "--lr"},
      {"--lr 1e300", "--lr"},        {"--lr -1", "--lr"},
      {"--min-lr inf", "--min-lr"},  {"--weight-decay nan", "--weight-decay"},
      {"--weight-decay -0.1", "--weight-decay"}, {"--beta1 1", "--beta1"},
      {"--beta1 nan", "--beta1"},    {"--beta2 -0.5", "--beta2"},
      {"--beta2 1.5", "--beta2"},    {"--eps 0", "--eps"},
      {"--eps -1e-8", "--eps"},      {"--eps nan", "--eps"},
      {"--grad-clip nan", "--grad-clip"}, {"--grad-clip -1", "--grad-clip"},
      {"--threads 100000", "--threads"},  {"--threads -2", "--threads"},
      {"--batch 4611686018427387904", "--batch"}, {"--batch 0", "--batch"},
      {"--grad-accum 4611686018427387904", "--grad-accum"}, {"--steps 0", "--steps"},
      {"--warmup -1", "--warmup"},   {"--log-every 0", "--log-every"}};
  for (const auto& [flags, name] : cases) {
    const Result r = run("train " + tiny() + "--seq 8 --batch 1 --steps 1 " + flags);
    EXPECT_GT(r.status, 0) << flags;
    EXPECT_LT(r.status, 128) << flags << " (killed by a signal?)";
    EXPECT_NE(r.err.find(name), std::string::npos) << flags << ": " << r.err;
    EXPECT_EQ(r.out.find("strata train"), std::string::npos) << flags << ": header printed";
  }
  // B·T overflow with the embedded corpus and with --data (past the corpus-size check).
  expect_refused(run("train " + tiny() + "--batch 4611686018427387904 --seq 8 --steps 1"), "--batch", "B x T");
}

// Sizes in config.json: a vocab whose byte count wraps, a billion layers; and a model too big
// for this machine's memory is refused with the numbers before anything is allocated.
TEST_F(TrainCli, AbsurdConfigsAreRefusedWithTheField) {
  expect_refused(run("train --model " + config_with("vocab_size", "4611686018427387904").string() +
                     " --threads 1 --steps 1 --batch 1 --seq 8"),
                 "vocab_size", "vocab 2^62");
  expect_refused(run("train --model " + config_with("num_hidden_layers", "1000000000").string() +
                     " --threads 1 --steps 1 --batch 1 --seq 8"),
                 "num_hidden_layers", "1e9 layers");
  expect_refused(run("train --model " + config_with("hidden_size", "1099511627776").string() +
                     " --threads 1 --steps 1 --batch 1 --seq 8"),
                 "hidden_size", "hidden 2^40");
  // 16384 wide, 64 layers, MLP 65536: ~270 billion parameters, > 4 TiB of RAM.
  nlohmann::json j = nlohmann::json::parse(slurp(dir_ / "tiny" / "config.json"));
  j["hidden_size"] = 16384;
  j["num_hidden_layers"] = 64;
  j["num_attention_heads"] = 128;
  j["num_key_value_heads"] = 128;
  j["intermediate_size"] = 65536;
  fs::create_directories(dir_ / "huge");
  std::ofstream(dir_ / "huge" / "config.json") << j.dump();
  const Result r = run("train --model " + (dir_ / "huge").string() + " --threads 1 --steps 1 --batch 1 --seq 8");
  expect_refused(r, "host memory", "huge model");
  EXPECT_NE(r.err.find("available"), std::string::npos) << r.err;
}

// --metrics on a full disk: one warning with the path and errno, training goes on and the model
// is saved; the file holds only whole lines.
TEST_F(TrainCli, MetricsWriteFailureWarnsAndTrainingContinues) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const Result r = run("train " + tiny() + "--steps 3 --batch 1 --seq 8 --metrics /dev/full --out " +
                       (dir_ / "model").string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("/dev/full"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("No space left on device"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;  // warned once
  EXPECT_NE(r.out.find("saved the model"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(dir_ / "model" / "model.safetensors"));
}

TEST_F(TrainCli, MetricsOnAFullTmpfsKeepsWholeLines) {
  const fs::path small = dir_ / "small";
  fs::create_directories(small);
  if (::mount("tmpfs", small.c_str(), "tmpfs", 0, "size=8k") != 0)
    GTEST_SKIP() << "cannot mount a small tmpfs (needs root): " << std::strerror(errno);
  const fs::path m = small / "m.jsonl";
  const Result r = run("train " + tiny() + "--steps 40 --batch 1 --seq 8 --log-every 100 --metrics " + m.string());
  const std::string text = slurp(m);
  ::umount2(small.c_str(), MNT_DETACH);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find(m.string()), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("No space left on device"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("done: 40 steps"), std::string::npos) << r.out;
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n');
  std::stringstream lines(text);
  int n = 0;
  for (std::string line; std::getline(lines, line); ++n) {
    EXPECT_TRUE(nlohmann::json::accept(line)) << "line " << n << ": " << line;
    EXPECT_EQ(nlohmann::json::parse(line)["step"], n + 1);
  }
  EXPECT_GT(n, 0);
  EXPECT_LT(n, 40);
}

TEST_F(TrainCli, WarmupLongerThanStepsWarns) {
  const Result r = run("train " + tiny() + "--steps 2 --warmup 10 --batch 1 --seq 8");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("--warmup 10"), std::string::npos) << r.err;
}

// The embedded corpus lives in strata-corpus-<pid>-XXXXXX in the temp folder; a run removes the
// ones whose process is gone (a crash or SIGKILL left them), and no others.
TEST_F(TrainCli, CorpusLeftoversOfDeadRunsAreRemoved) {
  const fs::path tmp = dir_ / "tmp";
  fs::create_directories(tmp);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  const fs::path dead = tmp / ("strata-corpus-" + std::to_string(child) + "-abcdef");
  const fs::path live = tmp / ("strata-corpus-" + std::to_string(::getpid()) + "-abcdef");
  for (const fs::path& d : {dead, live}) {
    fs::create_directories(d);
    std::ofstream(d / "corpus_bytes.bin") << "x";
  }
  const Result r = run("train " + tiny() + "--steps 1 --batch 1 --seq 8", "TMPDIR=" + tmp.string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live));
  // Quietly: the temp folder is shared by every run, so a notice would reach unrelated runs'
  // stderr (and made their one-line error checks flaky under ctest -j2).
  EXPECT_EQ(r.err.find("strata-corpus"), std::string::npos) << r.err;
  size_t left = 0;  // the run's own directory is gone too
  for (const auto& e : fs::directory_iterator(tmp)) left += e.path() != live;
  EXPECT_EQ(left, 0u);
}

}  // namespace

namespace {
// A run's losses from its --metrics file, in order.
std::vector<double> metric_losses(const fs::path& p) {
  std::vector<double> losses;
  std::ifstream f(p);
  for (std::string line; std::getline(f, line);) losses.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return losses;
}
}  // namespace

// --offload auto: the header names the pick and the runner-up with their predicted step times;
// with ample memory the pick is all-resident, an explicit flag stays as given, and the losses are
// the hand-placed run's (placement never changes the math).
TEST_F(TrainCli, OffloadAutoNamesItsChoice) {
  const std::string args = "train " + tiny() + "--batch 2 --seq 16 --steps 2 ";
  const Result hand = run(args + "--metrics " + (dir_ / "hand.jsonl").string());
  ASSERT_EQ(hand.status, 0) << hand.err;
  const Result a = run(args + "--offload auto --metrics " + (dir_ / "auto.jsonl").string());
  ASSERT_EQ(a.status, 0) << a.err;
  EXPECT_NE(a.out.find("offload auto: chose params none, grads none, optimizer none, activations none, checkpointing "
                       "none ("),
            std::string::npos)
      << a.out;
  EXPECT_NE(a.out.find("ms/step); runner-up params "), std::string::npos) << a.out;
  EXPECT_EQ(metric_losses(dir_ / "auto.jsonl"), metric_losses(dir_ / "hand.jsonl"));

  fs::create_directories(dir_ / "nvme");
  const Result n = run(args + "--offload-params nvme --offload auto --nvme-path " + (dir_ / "nvme").string() +
                       " --metrics " + (dir_ / "nvme.jsonl").string());
  ASSERT_EQ(n.status, 0) << n.err;
  EXPECT_NE(n.out.find("offload auto: chose params nvme, "), std::string::npos) << n.out;
  EXPECT_EQ(metric_losses(dir_ / "nvme.jsonl"), metric_losses(dir_ / "hand.jsonl"));
}

// A checkpoint records the pick's flags (and --offload auto); a resume with the same flags
// searches again and, the pick being the same, names no placement flag as changed.
TEST_F(TrainCli, OffloadAutoResumes) {
  const std::string args = "train " + tiny() + "--batch 2 --seq 16 --offload auto --checkpoint-dir " +
                           (dir_ / "ck").string() + " ";
  const Result first = run(args + "--steps 2");
  ASSERT_EQ(first.status, 0) << first.err;
  const Result again = run(args + "--steps 3 --resume auto");
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_NE(again.out.find("resumed"), std::string::npos) << again.out;
  const size_t at = again.out.find("changed since the checkpoint:");
  ASSERT_NE(at, std::string::npos) << again.out;  // --steps
  const std::string changed = again.out.substr(at, again.out.find('\n', at) - at);
  for (const char* flag : {"--offload", "--checkpoint-activations", "--device-mem", "--host-mem"})
    EXPECT_EQ(changed.find(flag), std::string::npos) << changed;
}

// In an mpirun job each rank would pick on its own probe: refused, naming the plan that does it.
TEST_F(TrainCli, OffloadAutoIsRefusedInAJob) {
  const Result r = run("train " + tiny() + "--batch 2 --seq 16 --steps 1 --offload auto", "OMPI_COMM_WORLD_SIZE=1");
  EXPECT_EQ(r.status, 0) << r.err;  // a one-rank "job" is a plain run
  const Result two = run("train " + tiny() + "--batch 2 --seq 16 --steps 1 --offload auto",
                         "OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_RANK=0");
  EXPECT_NE(two.status, 0);
  EXPECT_NE(two.err.find("--offload auto in a job of 2 ranks"), std::string::npos) << two.err;
}
