// `mpirun strata train --tp N` end to end (Megatron-LM's tensor parallelism over the CPU backend
// and OpenMPI): a tensor-parallel group trains the 1-rank model to fp32 reduction-order
// tolerance (losses, norms, saved weights), for gpt2 (fused c_attn, tied head, biases) and a
// llama with grouped-query attention and a vocabulary the group does not divide; a grid's run
// is reproducible bit for bit and independent of the placement; dp × tp with ZeRO matches too;
// its checkpoint is the HF layout, resumable on another grid; and a split that does not fit the
// model is refused naming the numbers.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "grid_cli_util.h"

namespace fs = std::filesystem;
using strata::test::CliResult;
using strata::test::slurp;

namespace {

using strata::test::rel;

// Bytes a tp rank sends per micro-batch (fp32, an all-reduce of S bytes sends 2·(t−1)/t·S):
// Megatron-LM's 4 all-reduces of the (B·T, h) activations per layer (2 forward, 2 backward),
// 2 more per recomputed layer, one for the embedding's rows and one for the head's input
// gradient; and the cross-entropy's 3 floats per row to each other rank.
uint64_t tp_bytes(int64_t rows, int64_t hidden, int64_t layers, int64_t recomputed, int64_t tp) {
  const uint64_t act = static_cast<uint64_t>(rows * hidden * 4);
  const uint64_t per_all_reduce = 2 * act * static_cast<uint64_t>(tp - 1) / static_cast<uint64_t>(tp);
  return static_cast<uint64_t>(4 * layers + 2 * recomputed + 2) * per_all_reduce +
         static_cast<uint64_t>(3 * rows * 4 * (tp - 1));
}

class TpCli : public strata::test::GridCli {
 protected:
  void SetUp() override {
    make_dir("strata_tp");
    if (!dir_.empty()) write_models(2);
  }
  std::string train(const std::string& model, int64_t batch, const std::string& tag, int64_t steps = 4) const {
    return train_args(model, batch, tag, steps);
  }
  // Runs `model` on 1 rank (tag model + "1") and on 2 ranks with `flags` (tag model + tag), and
  // compares them; returns the 2-rank run's output.
  CliResult against_one_rank(const std::string& model, const std::string& tag, const std::string& flags) {
    CliResult one = run(0, train(model, 2, model + "1"), model + "1");
    EXPECT_EQ(one.status, 0) << one.err;
    CliResult two = run(2, train(model, 2, model + tag) + flags, model + tag);
    EXPECT_EQ(two.status, 0) << two.out << two.err;
    if (one.status == 0 && two.status == 0) expect_close(model + "1", model + tag);
    return two;
  }
};

// Megatron-LM's tensor parallelism is the same model: tp 2 (and 4) within fp32 tolerance of 1
// rank (the same global batch), in both families, with a header that names the grid.
TEST_F(TpCli, TwoRanksMatchOneRank) {
  for (const std::string model : {"gpt2", "llama"}) {
    CliResult two = against_one_rank(model, "tp2", "--tp 2");
    EXPECT_NE(two.out.find("dp 1 × pp 1 × tp 2"), std::string::npos) << two.out;
    EXPECT_EQ(two.out.find("strata train"), two.out.rfind("strata train")) << "one header: " << two.out;
    ASSERT_EQ(metrics(model + "1").size(), 4u);
    // What it sent over the group, measured, is Megatron's count (2 × 32 rows, hidden 64, 2 layers).
    for (const auto& j : metrics(model + "tp2")) EXPECT_EQ(j["tp_comm_bytes_sent"].get<uint64_t>(), tp_bytes(64, 64, 2, 0, 2));
    EXPECT_FALSE(metrics(model + "1")[0].contains("tp_comm_bytes_sent"));
  }
  // tp 4 (gpt2: one head a rank, 64 vocabulary rows each): four parts summed in a fixed order,
  // 2·3/4 of each all-reduce sent, the cross-entropy's statistics to three others.
  CliResult r4 = run(4, train("gpt2", 2, "gpt2tp4") + "--tp 4", "gpt2tp4");
  ASSERT_EQ(r4.status, 0) << r4.err;
  expect_close("gpt21", "gpt2tp4");
  for (const auto& j : metrics("gpt2tp4")) EXPECT_EQ(j["tp_comm_bytes_sent"].get<uint64_t>(), tp_bytes(64, 64, 2, 0, 4));
}

// Sequence parallelism (--sequence-parallel): the residual stream split by rows, the same model
// to fp32 tolerance; the same bytes as tp alone (all-gathers and reduce-scatters of half the
// rows instead of all-reduces: 2·(t−1)/t·S each way) plus the norms' grads summed over the
// group (gpt2: weight and bias, 2 × 64 floats, per norm; 5 norms); and bitwise the same run
// whatever the placement, checkpointed blocks keeping only their rows of the input.
TEST_F(TpCli, SequenceParallelMatchesOneRank) {
  for (const std::string model : {"gpt2", "llama"}) {
    ASSERT_EQ(against_one_rank(model, "sp", "--tp 2 --sequence-parallel").status, 0);
    const uint64_t norms = model == "gpt2" ? 5 * 2 * 64 * 4 : 5 * 64 * 4;  // all-reduced at t = 2: sent once
    for (const auto& j : metrics(model + "sp"))
      EXPECT_EQ(j["tp_comm_bytes_sent"].get<uint64_t>(), tp_bytes(64, 64, 2, 0, 2) + norms) << model;
  }
  fs::create_directories(dir_ / "swap");
  CliResult off = run(2, train("gpt2", 2, "spoff") + "--tp 2 --sequence-parallel --offload-params nvme "
                                                    "--offload-grads cpu --offload-optimizer nvme "
                                                    "--checkpoint-activations full --nvme-path " + (dir_ / "swap").string(),
                      "spoff");
  ASSERT_EQ(off.status, 0) << off.err;
  EXPECT_EQ(losses("spoff"), losses("gpt2sp"));
  EXPECT_TRUE(slurp(dir_ / "spoff" / "model.safetensors") == slurp(dir_ / "gpt2sp" / "model.safetensors"));
  // Refused: without --tp, and rows (batch × seq) that the group does not divide.
  CliResult a = run(0, train("gpt2", 2, "a") + "--sequence-parallel", "a");
  EXPECT_NE(a.status, 0);
  EXPECT_NE(a.err.find("needs --tp 2 or more"), std::string::npos) << a.err;
  CliResult b = run(2, "train --model " + (dir_ / "gpt2").string() + " --threads 1 --seq 33 --batch 1 --steps 1 --tp 2 "
                       "--sequence-parallel", "b");
  EXPECT_NE(b.status, 0);
  EXPECT_NE(b.err.find("33 rows"), std::string::npos) << b.err;
}

// LoRA under tensor parallelism: a column-parallel layer's adapter has A whole and B split as
// the layer's output, a row-parallel one's A split as its input and B whole. Every linear layer
// adapted (all-linear), tp 2 with and without sequence parallelism and with dropout: the 1-rank
// run's losses, norms and saved adapter (PEFT names, whole shapes) and merged model; a tp 2
// checkpoint resumes on 1 rank (the frozen base's crc is the whole tensors', the same on any
// grid).
TEST_F(TpCli, LoraMatchesOneRank) {
  const std::string lora = " --lora-rank 4 --lora-targets all-linear ";
  struct Case {
    std::string tag, flags, dropout;
  };
  const std::vector<Case> cases = {{"ltp", "--tp 2", ""},
                                   {"lsp", "--tp 2 --sequence-parallel", ""},
                                   {"ldrop", "--tp 2", " --lora-dropout 0.1"}};  // masks of the whole layer's columns
  for (const std::string model : {"gpt2", "llama"}) {
    for (const Case& k : cases) {
      const std::string ref = model + "l1" + k.tag, tag = model + k.tag;
      CliResult one = run(0, train(model, 2, ref) + lora + k.dropout, ref);
      ASSERT_EQ(one.status, 0) << one.err;
      CliResult two = run(2, train(model, 2, tag) + lora + k.dropout + " " + k.flags, tag);
      ASSERT_EQ(two.status, 0) << two.err;
      const auto a = metrics(ref), b = metrics(tag);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_LT(rel(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()), 1e-5) << tag << " step " << i + 1;
        EXPECT_LT(rel(a[i]["grad_norm"].get<double>(), b[i]["grad_norm"].get<double>()), 1e-5) << tag;
      }
      const auto adapter = [&](const std::string& run) {
        return strata::test::tensors_of(*strata::HfCheckpoint::open_file(dir_ / run / "adapter_model.safetensors"));
      };
      const auto wa = adapter(ref), wb = adapter(tag);
      ASSERT_EQ(wa.size(), wb.size()) << tag;
      for (const auto& [name, va] : wa) {
        ASSERT_TRUE(wb.count(name)) << tag << " lacks " << name;
        ASSERT_EQ(va.size(), wb.at(name).size()) << tag << ": " << name;
        double worst = 0;
        for (size_t i = 0; i < va.size(); ++i) worst = std::max(worst, std::abs(double(va[i]) - wb.at(name)[i]));
        EXPECT_LT(worst, 1e-5) << tag << ": " << name;
      }
    }
  }
  // --merge-adapter: the base's and the adapters' whole tensors on rank 0, W + s·B·A there; a
  // random base (gpt2, llama) is gathered from the parts, a base from a file (lbase) is the
  // whole tensors rank 0 reads anyway.
  ASSERT_EQ(run(0, train("llama", 2, "lbase", 1), "lbase").status, 0);
  for (const std::string model : {"gpt2", "llama", "lbase"}) {
    CliResult one = run(0, train(model, 2, model + "m1", 2) + lora + "--merge-adapter", model + "m1");
    ASSERT_EQ(one.status, 0) << one.err;
    CliResult two = run(2, train(model, 2, model + "m2", 2) + lora + "--merge-adapter --tp 2", model + "m2");
    ASSERT_EQ(two.status, 0) << two.err;
    expect_close(model + "m1", model + "m2");
  }
  // A tp 2 checkpoint resumes on 1 rank: the frozen base's crc (trainer.json) is the whole
  // tensors', the same on either grid, from a random base and from a file.
  for (const std::string model : {"llama", "lbase"}) {
    const std::string ck = (dir_ / (model + "ck")).string();
    CliResult two = run(2, train(model, 2, model + "c2") + lora + "--tp 2 --checkpoint-every 2 --checkpoint-dir " + ck,
                        model + "c2");
    ASSERT_EQ(two.status, 0) << two.err;
    CliResult one = run(0, train(model, 2, model + "c1") + lora + "--resume " + ck + "/step-00000002", model + "c1");
    ASSERT_EQ(one.status, 0) << one.err;
    const auto a = metrics(model + "c2"), b = metrics(model + "c1");
    ASSERT_EQ(b.size(), 2u);
    for (size_t i = 0; i < 2; ++i)
      EXPECT_LT(rel(a[i + 2]["loss"].get<double>(), b[i]["loss"].get<double>()), 1e-5) << model << " step " << i + 3;
  }
}

// Packed chat documents (block-diagonal attention, positions per document, a loss mask) and
// held-out validation under tp 2, with and without sequence parallelism: the 1-rank run's
// losses, validation losses and trained-token counts.
TEST_F(TpCli, DocumentsAndValidationMatchOneRank) {
  const std::string data = document_flags();
  for (const std::string flags : {"--tp 2", "--tp 2 --sequence-parallel"}) {
    const std::string tag = flags.size() > 6 ? "docsp" : "doctp";
    CliResult one = run(0, train("llama", 2, "doc1") + data, "doc1");
    ASSERT_EQ(one.status, 0) << one.err;
    CliResult two = run(2, train("llama", 2, tag) + data + flags, tag);
    ASSERT_EQ(two.status, 0) << two.err;
    expect_same_evaluations("doc1", tag, 1e-5);
    fs::remove(dir_ / "doc1.jsonl");  // (appended to by the next run otherwise)
  }
}

// A grid's run is a fixed function of its inputs: the same bits twice, with every stream task
// (collectives included) started after a random delay (STRATA_TEST_STREAM_JITTER_US), with
// speculative updates, and whatever the placement (params, grads and optimizer state in RAM or
// on NVMe, checkpointed blocks).
TEST_F(TpCli, RunsAreBitwiseReproducibleAndPlacementFree) {
  const std::string ref = "ref";
  CliResult a = run(2, train("llama", 2, ref) + "--tp 2", ref);
  ASSERT_EQ(a.status, 0) << a.err;
  fs::create_directories(dir_ / "swap");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"again", ""},
      {"jitter", "env:STRATA_TEST_STREAM_JITTER_US=300"},
      {"spec", "--speculate on --offload-optimizer cpu"},  // updates in the backward, rolled back when they clip
      {"cpu", "--offload-params cpu --offload-grads cpu --offload-optimizer cpu --checkpoint-activations full"},
      {"nvme", "--offload-params nvme --offload-grads nvme --offload-optimizer nvme --checkpoint-activations "
               "every:2 --nvme-path " + (dir_ / "swap").string()},
  };
  for (const auto& [tag, flags] : cases) {
    const bool jitter = flags.rfind("env:", 0) == 0;
    CliResult b = run(2, train("llama", 2, tag) + "--tp 2 " + (jitter ? "" : flags), tag,
                      jitter ? flags.substr(4) : "");
    ASSERT_EQ(b.status, 0) << tag << ": " << b.err;
    EXPECT_EQ(losses(tag), losses(ref)) << tag;
    const int64_t recomputed = tag == "cpu" ? 2 : tag == "nvme" ? 1 : 0;  // full; every:2 of 2 layers
    const nlohmann::json first = metrics(tag)[0];  // (a rolled-back step runs its forward and backward again)
    EXPECT_EQ(first["tp_comm_bytes_sent"].get<uint64_t>(),
              (first.value("rolled_back", false) ? 2 : 1) * tp_bytes(64, 64, 2, recomputed, 2))
        << tag;
    EXPECT_TRUE(slurp(dir_ / tag / "model.safetensors") == slurp(dir_ / ref / "model.safetensors")) << tag;
  }
}

// dp 2 × tp 2 on 4 ranks with ZeRO over the data-parallel pairs: the 1-rank run with the same
// global batch.
TEST_F(TpCli, DataTimesTensorParallelWithZeroMatchesOneRank) {
  CliResult one = run(0, train("gpt2", 2, "one"), "one");
  ASSERT_EQ(one.status, 0) << one.err;
  // Every ZeRO stage composes with tp (each shards the rank's own part over its replicas), and,
  // as without tp, all four give the same bits.
  for (const std::string stage : {"1", "0", "2", "3"}) {
    CliResult four = run(4, train("gpt2", 1, "four" + stage) + "--tp 2 --zero-stage " + stage, "four" + stage);
    ASSERT_EQ(four.status, 0) << four.out << four.err;
    EXPECT_NE(four.out.find("dp 2 × pp 1 × tp 2"), std::string::npos) << four.out;
    if (stage == "1") {
      expect_close("one", "four1");
      continue;
    }
    EXPECT_EQ(losses("four" + stage), losses("four1")) << "stage " << stage;
    EXPECT_TRUE(slurp(dir_ / ("four" + stage) / "model.safetensors") == slurp(dir_ / "four1" / "model.safetensors"))
        << "stage " << stage;
  }
}

// The checkpoint holds whole HF tensors: a tp 2 run's resumes on 1 rank, and 1 rank's on tp 2,
// continuing the same run to fp32 tolerance.
TEST_F(TpCli, CheckpointResumesOnAnotherGrid) {
  expect_resumes_across_grids([&](const std::string& tag) { return train("llama", 2, tag); }, 2, "--tp 2");
}

// `strata plan --tp N --world W` plans tp rank 0's part: what a run measures it sends over the
// tp group (with and without sequence parallelism and recomputed blocks), about 1/tp of the
// layers' bytes per tier, and the whole model's parameter count.
TEST_F(TpCli, PlanCountsWhatARankHoldsAndSends) {
  for (const std::string flags : {"", "--sequence-parallel --checkpoint-activations full"}) {
    const std::string tag = flags.empty() ? "t" : "tsp";
    CliResult t = run(2, train("gpt2", 2, tag, 2) + "--tp 2 " + flags, tag);
    ASSERT_EQ(t.status, 0) << t.err;
    const std::string plan =
        "plan --model " + (dir_ / "gpt2").string() + " --seq 32 --batch 2 --threads 1 --probe-seconds 0.05 --json ";
    CliResult p2 = run(0, plan + "--tp 2 --world 2 " + flags, "p2");
    ASSERT_EQ(p2.status, 0) << p2.err;
    CliResult p1 = run(0, plan + (flags.empty() ? "" : "--checkpoint-activations full"), "p1");
    ASSERT_EQ(p1.status, 0) << p1.err;
    const auto j2 = nlohmann::json::parse(p2.out), j1 = nlohmann::json::parse(p1.out);
    EXPECT_EQ(j2["tp_comm_bytes_sent_per_rank"].get<uint64_t>(), metrics(tag)[0]["tp_comm_bytes_sent"].get<uint64_t>())
        << flags;
    EXPECT_EQ(j1["tp_comm_bytes_sent_per_rank"].get<uint64_t>(), 0u);
    EXPECT_EQ(j2["params"], j1["params"]);  // the model's, not the part's
    // gpt2 tiny: the embedding (vocab 256 + 64 positions) is most of it; every tensor but the
    // norms, the positions and two biases per layer splits.
    const double part = j2["master_bytes"].get<double>() + j2["params_bytes"].get<double>();
    const double whole = j1["master_bytes"].get<double>() + j1["params_bytes"].get<double>();
    EXPECT_LT(part, 0.65 * whole) << flags;
    EXPECT_GT(part, 0.5 * whole) << flags;
    EXPECT_GT(j2["predicted_step_ms"].get<double>(), 0.0);
  }
}

// A rank killed mid-step (its tp collectives enqueued on the compute stream, its partner
// waiting in one) takes the job down within 30 s, naming it, as with ZeRO; likewise in a
// dp × tp grid.
TEST_F(TpCli, AKilledRankStopsTheJob) {
  expect_killed_rank_stops_the_job(2, train("llama", 2, "kill", 50) + "--tp 2");
  expect_killed_rank_stops_the_job(4, train("llama", 1, "kill", 50) + "--tp 2 --zero-stage 1");
}

// A split the job or the model cannot take is refused before anything runs, naming the numbers.
TEST_F(TpCli, SplitsThatDoNotFitAreRefused) {
  CliResult a = run(2, train("llama", 2, "a") + "--tp 4", "a");
  EXPECT_NE(a.status, 0);
  EXPECT_NE(a.err.find("--tp 4"), std::string::npos) << a.err;
  CliResult b = run(4, train("llama", 1, "b") + "--tp 4", "b");  // 2 kv heads
  EXPECT_NE(b.status, 0);
  EXPECT_NE(b.err.find("key/value heads (2)"), std::string::npos) << b.err;
  CliResult d = run(0, train("llama", 2, "d") + "--tp 0", "d");
  EXPECT_NE(d.status, 0);
  EXPECT_NE(d.err.find("--tp 0"), std::string::npos) << d.err;
  CliResult e = run(0, "plan --model " + (dir_ / "llama").string() + " --seq 32 --tp 2 --world 3", "e");
  EXPECT_NE(e.status, 0);
  EXPECT_NE(e.err.find("does not divide the 3 ranks"), std::string::npos) << e.err;
}

}  // namespace
