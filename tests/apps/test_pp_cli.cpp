// `mpirun strata train --pp N` end to end (Megatron-LM's pipeline parallelism, the 1F1B schedule,
// over the CPU backend and OpenMPI): the stages train the 1-rank model with the same global
// batch (an untied llama bit for bit: each stage runs the 1-rank ops in their order; gpt2's tied
// head to fp32 reduction-order tolerance, its embedding's two copies summed); pipelines compose
// with data parallelism (ZeRO 0-1) and tensor parallelism; a stage's run is reproducible and
// independent of random delays and checkpointing; validation runs through the stages; its
// checkpoint is the HF layout, resumable on another grid; a killed stage stops the job; and what
// the pipeline cannot take is refused naming the flag.
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

class PpCli : public strata::test::GridCli {
 protected:
  void SetUp() override {
    make_dir("strata_pp");
    if (!dir_.empty()) write_models(4);  // (gpt2's tied head: the last stage keeps a copy of the embedding)
  }
  // 4 micro-batches of `batch` rows a step.
  std::string train(const std::string& model, int64_t batch, const std::string& tag, int64_t steps = 4) const {
    return train_args(model, batch, tag, steps, "--grad-accum 4 ");
  }
};

// The stages are the 1-rank model (the same global batch: 4 micro-batches of 2 rows). The
// untied llama bit for bit (each stage runs the 1-rank ops in their order; the schedule only
// interleaves micro-batches, which write their own activations); gpt2 within fp32 tolerance (its
// tied embedding's two gradients, the first stage's and the head's on the last, are summed
// once at the end instead of in micro-batch order). 2 stages and 4 (middle stages that send
// both ways); an uneven split; what stage 0 sends is Megatron's count.
TEST_F(PpCli, StagesMatchOneRank) {
  for (const std::string model : {"llama", "gpt2"}) {
    CliResult one = run(0, train(model, 2, model + "1"), model + "1");
    ASSERT_EQ(one.status, 0) << one.err;
    CliResult two = run(2, train(model, 2, model + "pp2") + "--pp 2", model + "pp2");
    ASSERT_EQ(two.status, 0) << two.out << two.err;
    EXPECT_NE(two.out.find("dp 1 × pp 2 × tp 1"), std::string::npos) << two.out;
    EXPECT_NE(two.out.find("2 stages of 2,2 layers"), std::string::npos) << two.out;
    EXPECT_NE(two.out.find("ideal bubble (p-1)/(m+p-1) = 20.0%"), std::string::npos) << two.out;
    expect_close(model + "1", model + "pp2");
    if (model == "llama") {
      EXPECT_EQ(losses("llamapp2"), losses("llama1"));
      EXPECT_TRUE(same_weights("llamapp2", "llama1"));
    }
    // Stage 0 (rank 0 writes the metrics) sends each micro-batch's (B·T, h) fp32 activations
    // forward: 4 × 2·32·64·4 bytes; gpt2's adds its embedding's gradient (256 + 64 rows of 64),
    // all-reduced with the last stage (2·(2−1)/2 of it sent).
    const uint64_t acts = 4 * 2 * 32 * 64 * 4, tie = model == "gpt2" ? (256 + 64) * 64 * 4 : 0;
    for (const auto& j : metrics(model + "pp2")) {
      EXPECT_EQ(j["pp_comm_bytes_sent"].get<uint64_t>(), acts + tie) << model;
      EXPECT_GT(j["pp_bubble"].get<double>(), 0.0);
      EXPECT_LT(j["pp_bubble"].get<double>(), 1.0);
    }
    EXPECT_FALSE(metrics(model + "1")[0].contains("pp_comm_bytes_sent"));
  }
  CliResult four = run(4, train("gpt2", 2, "gpt2pp4") + "--pp 4", "gpt2pp4");
  ASSERT_EQ(four.status, 0) << four.out << four.err;
  expect_close("gpt21", "gpt2pp4");
  CliResult uneven = run(2, train("llama", 2, "uneven") + "--pp 2 --pp-layers 1,3", "uneven");
  ASSERT_EQ(uneven.status, 0) << uneven.out << uneven.err;
  EXPECT_NE(uneven.out.find("2 stages of 1,3 layers"), std::string::npos) << uneven.out;
  EXPECT_EQ(losses("uneven"), losses("llama1"));
}

// A grid with pipelines: dp 2 × pp 2 with ZeRO stage 0 and 1 over the data-parallel pairs (the
// same bits as each other), tp 2 × pp 2, and all three axes at once, each the 1-rank run with the
// same global batch.
TEST_F(PpCli, PipelinesComposeWithDataAndTensorParallelism) {
  CliResult one = run(0, train("gpt2", 2, "one"), "one");
  ASSERT_EQ(one.status, 0) << one.err;
  for (const std::string stage : {"1", "0"}) {
    CliResult r = run(4, train("gpt2", 1, "dp" + stage) + "--pp 2 --zero-stage " + stage, "dp" + stage);
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("dp 2 × pp 2 × tp 1"), std::string::npos) << r.out;
    expect_close("one", "dp" + stage);
  }
  EXPECT_EQ(losses("dp0"), losses("dp1"));
  EXPECT_TRUE(same_weights("dp0", "dp1"));
  CliResult t = run(4, train("gpt2", 2, "tp") + "--pp 2 --tp 2", "tp");
  ASSERT_EQ(t.status, 0) << t.out << t.err;
  EXPECT_NE(t.out.find("dp 1 × pp 2 × tp 2"), std::string::npos) << t.out;
  expect_close("one", "tp");
  // 3D: dp 2 × pp 2 × tp 2 with ZeRO-1 over the data-parallel pairs (8 ranks on 2 cores).
  CliResult d = run(8, train("gpt2", 1, "3d") + "--pp 2 --tp 2 --zero-stage 1", "3d");
  ASSERT_EQ(d.status, 0) << d.out << d.err;
  EXPECT_NE(d.out.find("dp 2 × pp 2 × tp 2"), std::string::npos) << d.out;
  expect_close("one", "3d");
}

// A pipeline's run is a fixed function of its inputs: the same bits twice, with every stream
// task (the sends and receives included) started after a random delay, and whatever the
// placement: each stage's checkpointed blocks (each slot's kept inputs recomputed from, in RAM
// or on NVMe), params, grads and optimizer state in RAM or on NVMe, the optimizer on a runtime
// of its own (as beside a GPU), ZeRO-1 with its state on NVMe.
TEST_F(PpCli, RunsAreBitwiseReproducibleAndPlacementFree) {
  CliResult a = run(2, train("gpt2", 2, "ref") + "--pp 2", "ref");
  ASSERT_EQ(a.status, 0) << a.err;
  fs::create_directories(dir_ / "swap");
  const std::string swap = " --nvme-path " + (dir_ / "swap").string();
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"again", "", ""},
      {"jitter", "", "STRATA_TEST_STREAM_JITTER_US=300"},
      {"full", "--checkpoint-activations full", ""},
      {"cpu", "--offload-params cpu --offload-grads cpu --offload-optimizer cpu --checkpoint-activations every:2", ""},
      {"nvme", "--offload-params nvme --offload-grads nvme --offload-optimizer nvme --checkpoint-activations full "
               "--offload-activations nvme" + swap, ""},
      {"separate", "--offload-optimizer cpu", "STRATA_FAULT=separate-optimizer"},
  };
  for (const auto& [tag, flags, env] : cases) {
    CliResult b = run(2, train("gpt2", 2, tag) + "--pp 2 " + flags, tag, env);
    ASSERT_EQ(b.status, 0) << tag << ": " << b.err;
    EXPECT_EQ(losses(tag), losses("ref")) << tag;
    EXPECT_TRUE(same_weights(tag, "ref")) << tag;
  }
}

// In bf16 too the untied llama's stages are the 1-rank run bit for bit.
TEST_F(PpCli, Bf16StagesAreTheOneRankRun) {
  CliResult one = run(0, train("llama", 2, "b1") + "--dtype bf16", "b1");
  ASSERT_EQ(one.status, 0) << one.err;
  CliResult two = run(2, train("llama", 2, "b2") + "--dtype bf16 --pp 2", "b2");
  ASSERT_EQ(two.status, 0) << two.err;
  EXPECT_EQ(losses("b2"), losses("b1"));
  EXPECT_TRUE(same_weights("b2", "b1"));
}

// Validation runs through the stages too: the held-out loss of the 1-rank run.
TEST_F(PpCli, ValidationMatchesOneRank) {
  const std::string data = document_flags();
  CliResult one = run(0, train("llama", 2, "doc1") + data, "doc1");
  ASSERT_EQ(one.status, 0) << one.err;
  CliResult two = run(2, train("llama", 2, "doc2") + data + "--pp 2", "doc2");
  ASSERT_EQ(two.status, 0) << two.err;
  expect_same_evaluations("doc1", "doc2", 1e-6);
}

// The checkpoint holds whole HF tensors: a pp 2 run's resumes on 1 rank, and 1 rank's on pp 2,
// continuing the run to fp32 tolerance; on the same grid bit for bit.
TEST_F(PpCli, CheckpointResumesOnAnotherGrid) {
  expect_resumes_across_grids([&](const std::string& tag) { return train("gpt2", 2, tag); }, 2, "--pp 2");
}

// A stage killed mid-step (its neighbour waiting in a receive) takes the job down within 30 s,
// naming the rank, as with ZeRO and tp.
TEST_F(PpCli, AKilledStageStopsTheJob) { expect_killed_rank_stops_the_job(2, train("llama", 2, "kill", 50) + "--pp 2"); }

// `strata plan --pp 2 --world 2` plans every stage: what a run measures its busiest rank sends
// to its neighbours, the ideal bubble, each stage's layers and pools (together about the 1-rank
// run's, the last stage's copy of the tied embedding aside), the tiers of the largest.
TEST_F(PpCli, PlanCountsWhatAStageHoldsAndSends) {
  CliResult t = run(2, train("gpt2", 2, "t", 2) + "--pp 2", "t");
  ASSERT_EQ(t.status, 0) << t.err;
  const std::string plan = "plan --model " + (dir_ / "gpt2").string() +
                           " --seq 32 --batch 2 --grad-accum 4 --threads 1 --probe-seconds 0.05 --json ";
  CliResult p2 = run(0, plan + "--pp 2 --world 2", "p2");
  ASSERT_EQ(p2.status, 0) << p2.err;
  CliResult p1 = run(0, plan, "p1");
  ASSERT_EQ(p1.status, 0) << p1.err;
  const auto j2 = nlohmann::json::parse(p2.out), j1 = nlohmann::json::parse(p1.out);
  EXPECT_EQ(j2["pp_comm_bytes_sent_per_rank"].get<uint64_t>(), metrics("t")[0]["pp_comm_bytes_sent"].get<uint64_t>());
  EXPECT_DOUBLE_EQ(j2["pp_bubble"].get<double>(), 0.2);
  EXPECT_EQ(j2["pp_layers"], nlohmann::json::array({2, 2}));
  EXPECT_EQ(j1["pp"].get<int>(), 1);
  EXPECT_FALSE(j1.contains("pp_stages"));
  EXPECT_EQ(j2["params"], j1["params"]);  // the model's, not a stage's
  ASSERT_EQ(j2["pp_stages"].size(), 2u);
  int64_t trained = 0;
  for (const auto& s : j2["pp_stages"]) trained += s["trainable_params"].get<int64_t>();
  // gpt2 tiny: 4 layers of 49,984, the embedding 20,480 (on both ends), the final norm 128.
  EXPECT_EQ(trained, j1["params"].get<int64_t>() + (256 + 64) * 64);
  const uint64_t device = j2["device_budget_bytes"].get<uint64_t>();
  for (const auto& s : j2["pp_stages"]) EXPECT_LE(s["device_budget_bytes"].get<uint64_t>(), device);
  EXPECT_LT(device, j1["device_budget_bytes"].get<uint64_t>());
  EXPECT_GT(j2["predicted_step_ms"].get<double>(), 0.0);
}

// What the pipeline cannot take is refused before anything runs, naming the flag and numbers.
TEST_F(PpCli, WhatThePipelineCannotTakeIsRefused) {
  const std::vector<std::tuple<int, std::string, std::string>> cases = {
      {2, "--pp 4", "--pp 4"},                                   // more stages than ranks
      {4, "--pp 8", "--pp 8"},                                   // ... and than layers
      {2, "--pp 2 --pp-layers 1,1", "sum to the model's 4 layers"},
      {2, "--pp 2 --pp-layers 2,x", "--pp-layers 2,x"},
      {0, "--pp-layers 2,2", "--pp-layers needs --pp 2"},
      {2, "--pp 2 --zero-stage 2", "--zero-stage 2 with --pp"},
      {2, "--pp 2 --lora-rank 4", "with --pp"},
      {0, "--pp 0", "--pp 0"},
  };
  for (const auto& [np, flags, says] : cases) {
    CliResult r = run(np, train("llama", 2, "bad") + flags, "bad");
    EXPECT_NE(r.status, 0) << flags;
    EXPECT_NE(r.err.find(says), std::string::npos) << flags << ": " << r.err;
  }
}

}  // namespace
