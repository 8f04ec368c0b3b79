// `strata plan` through the built binary: a GPU modeled from the table or from figures where none
// is present (its peak, memory and link as printed and in --json), and a scaled probe's plan
// against the exact probe's (the bytes identical, the times only within a loose bound).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <nlohmann/json.hpp>

#include "src/train/gpu_specs.h"
#include "tests/apps/cli_test_util.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

class PlanCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = strata::test::make_scratch_dir("strata_plan");
    ASSERT_FALSE(dir_.empty());
    strata::test::write_tiny_llama(dir_ / "tiny", 128, 4, 256);
    strata::test::write_tiny_llama(dir_ / "wide", 512, 2, 1024);  // 4 heads of 128, 2 kv heads
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string plan(const std::string& model) const {
    return "plan --model " + (dir_ / model).string() + " --threads 1 --probe-seconds 0.05 --seq 64 ";
  }
  // `strata ARGS --json`, which must succeed.
  json plan_json(const std::string& args) {
    const strata::test::CliResult r = strata::test::run_strata(dir_, args + " --json");
    EXPECT_EQ(r.status, 0) << args << ": " << r.err;
    return r.status == 0 ? json::parse(r.out) : json::object();
  }
  fs::path dir_;
};

// Every GPU of the table, with no GPU here (and over one that is): the plan says it is modeled,
// and its peak for the dtype, memory and PCIe are the table's; compute is the FLOPs at that
// peak times the stated efficiency, so an fp32 plan on the same GPU is slower by the ratio of
// the peaks.
TEST_F(PlanCli, ModelsEveryKnownGpuWithoutOne) {
  for (const strata::GpuSpec& g : strata::known_gpus()) {
    const std::string args = plan("tiny") + "--backend cuda --gpu " + g.name;
    const json bf16 = plan_json(args + " --dtype bf16"), fp32 = plan_json(args);
    ASSERT_TRUE(bf16.contains("device") && fp32.contains("device")) << g.name;
    EXPECT_EQ(bf16["device"]["modeled"], true);
    EXPECT_EQ(bf16["device"]["name"], g.name);
    EXPECT_DOUBLE_EQ(bf16["device"]["peak_tflops"].get<double>(), g.bf16_tflops);
    EXPECT_DOUBLE_EQ(fp32["device"]["peak_tflops"].get<double>(), g.fp32_tflops);
    EXPECT_DOUBLE_EQ(bf16["device"]["efficiency"].get<double>(), strata::kModeledMfu);
    EXPECT_DOUBLE_EQ(bf16["device"]["memory_gib"].get<double>(), g.mem_gib);
    EXPECT_DOUBLE_EQ(bf16["h2d_gbps"].get<double>(), g.pcie_gbs);
    EXPECT_DOUBLE_EQ(bf16["d2h_gbps"].get<double>(), g.pcie_gbs);
    EXPECT_FALSE(bf16.contains("probe")) << "a modeled GPU probes no phases";
    EXPECT_NEAR(fp32["block_forward_ms"].get<double>() / bf16["block_forward_ms"].get<double>(),
                g.bf16_tflops / g.fp32_tflops, 1e-9);
  }
  const strata::test::CliResult r = strata::test::run_strata(dir_, plan("tiny") + "--backend cuda --gpu h100");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("device: modeled, not measured: h100 (NVIDIA H100 SXM5 80GB): fp32 peak 67 TFLOP/s dense x "
                       "37.6%"),
            std::string::npos)
      << r.out;
}

// A GPU described by figures, and a named one with one figure overridden: those figures are the
// plan's, and doubling the TFLOP/s halves each phase (the modeled times are FLOPs over rates).
TEST_F(PlanCli, ModelsAGpuFromExplicitFigures) {
  const std::string custom = plan("tiny") + "--backend cuda --gpu-mem 16 --pcie-gbs 16 --gpu-hbm-gbs 500 ";
  const json a = plan_json(custom + "--gpu-tflops 100"), b = plan_json(custom + "--gpu-tflops 200");
  ASSERT_TRUE(a.contains("device") && b.contains("device"));
  EXPECT_EQ(a["device"]["name"], "custom");
  EXPECT_DOUBLE_EQ(a["device"]["peak_tflops"].get<double>(), 100);
  EXPECT_DOUBLE_EQ(a["device"]["memory_gib"].get<double>(), 16);
  EXPECT_DOUBLE_EQ(a["device"]["hbm_gbs"].get<double>(), 500);
  EXPECT_DOUBLE_EQ(a["h2d_gbps"].get<double>(), 16);
  EXPECT_NEAR(a["block_forward_ms"].get<double>(), 2 * b["block_forward_ms"].get<double>(), 1e-12);
  EXPECT_NEAR(a["edge_ms"].get<double>(), 2 * b["edge_ms"].get<double>(), 1e-12);
  const json h = plan_json(plan("tiny") + "--backend cuda --gpu h100 --pcie-gbs 32");
  ASSERT_TRUE(h.contains("device"));
  EXPECT_EQ(h["device"]["name"], "h100");
  EXPECT_DOUBLE_EQ(h["device"]["pcie_gbs"].get<double>(), 32);
  EXPECT_DOUBLE_EQ(h["device"]["memory_gib"].get<double>(), strata::find_gpu("h100")->mem_gib);
}

// A scaled probe (a budget of 0.001 GFLOP: batch 1, half the width) against the exact one on the
// same model and flags: what the plan holds and moves is the same to the byte; the predicted
// step agrees within a loose factor (both are timings of this machine).
TEST_F(PlanCli, ScaledProbePlansTheSameBytesAndACloseStep) {
  const std::string args = plan("wide") + "--batch 2 --dtype bf16 --offload-optimizer cpu";
  const json exact = plan_json(args + " --probe-gflop 1e6"), scaled = plan_json(args + " --probe-gflop 0.001");
  ASSERT_TRUE(exact.contains("probe") && scaled.contains("probe"));
  EXPECT_EQ(exact["probe"]["extrapolated"], false);
  EXPECT_EQ(scaled["probe"]["extrapolated"], true);
  EXPECT_EQ(scaled["probe"]["batch"], 1);
  EXPECT_EQ(scaled["probe"]["width_div"], 2);
  for (const auto& [key, value] : exact.items())
    if (key.ends_with("_bytes") || key == "params" || key == "tokens_per_step") {
      EXPECT_EQ(scaled[key], value) << key;
    }
  const double e = exact["predicted_step_ms"].get<double>(), s = scaled["predicted_step_ms"].get<double>();
  EXPECT_GT(s, e / 5);
  EXPECT_LT(s, e * 5);
  const strata::test::CliResult r = strata::test::run_strata(dir_, args + " --probe-gflop 0.001");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("compute: extrapolated: the phases timed on a scaled one-block copy (batch 1, seq 64, "
                       "width 1/2, vocab 256 of 256"),
            std::string::npos)
      << r.out;
}

}  // namespace

// `--offload auto` (src/train/auto_placement.h): the placements searched from one probe.
class PlanAutoCli : public PlanCli {
 protected:
  std::string auto_plan() const { return plan("tiny") + "--offload auto "; }
  static void expect_fits(const json& j, uint64_t device, uint64_t host) {
    EXPECT_LE(j["device_budget_bytes"].get<uint64_t>(), device);
    EXPECT_LE(j["host_budget_bytes"].get<uint64_t>(), host);
    for (const json& c : j["auto"]["fitting"]) {
      EXPECT_LE(c["device_bytes"].get<uint64_t>(), device) << c.dump();
      EXPECT_LE(c["host_bytes"].get<uint64_t>(), host) << c.dump();
    }
  }
};

// With the machine's memory the pick is all-resident, and the plan printed is the pick's: the
// hand placement (the defaults) is the first candidate, so the pick is never slower than it.
TEST_F(PlanAutoCli, AmpleMemoryPicksAllResident) {
  const json j = plan_json(auto_plan());
  ASSERT_TRUE(j.contains("auto")) << j.dump();
  const json& best = j["auto"]["fitting"][0];
  for (const char* k : {"params", "grads", "optimizer", "activations", "checkpointing"}) EXPECT_EQ(best[k], "none") << k;
  EXPECT_EQ(j["auto"]["candidates"], 40) << "no --nvme-path: no NVMe candidates";
  EXPECT_DOUBLE_EQ(best["predicted_step_ms"].get<double>(), j["predicted_step_ms"].get<double>());
  for (const json& c : j["auto"]["fitting"])
    EXPECT_LE(best["predicted_step_ms"].get<double>(), c["predicted_step_ms"].get<double>());
  const strata::test::CliResult r = strata::test::run_strata(dir_, auto_plan());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("offload auto: 40 placements"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("placement: params none, grads none, optimizer none, activations none (checkpointing none)"),
            std::string::npos)
      << r.out;
}

// Small budgets and a disk: the pick and every ranked candidate fit them; NVMe holds the rest.
// The tiny model needs 19 MiB all-resident.
TEST_F(PlanAutoCli, SmallBudgetsPickWhatFits) {
  fs::create_directories(dir_ / "nvme");
  for (const uint64_t device_mib : {8, 4}) {
    const json j = plan_json(auto_plan() + "--device-mem " + std::to_string(device_mib) +
                             "M --host-mem 6M --nvme-bw 1 --nvme-path " + (dir_ / "nvme").string());
    ASSERT_TRUE(j.contains("auto")) << j.dump();
    expect_fits(j, device_mib << 20, 6u << 20);
    EXPECT_GT(j["nvme_budget_bytes"].get<uint64_t>(), 0u);
    EXPECT_GT(j["auto"]["refused_device"].get<int>(), 0);
    // The hand placement for a small machine (everything on NVMe, full checkpointing), where it
    // fits, is ranked from the same probe, and the pick is never slower than it.
    bool hand_ranked = false;
    for (const json& c : j["auto"]["fitting"])
      if (c["params"] == "nvme" && c["grads"] == "nvme" && c["optimizer"] == "nvme" && c["activations"] == "none" &&
          c["checkpointing"] == "full") {
        hand_ranked = true;
        EXPECT_LE(j["auto"]["fitting"][0]["predicted_step_ms"].get<double>(), c["predicted_step_ms"].get<double>());
      }
    if (device_mib == 8) {
      EXPECT_TRUE(hand_ranked) << j["auto"].dump();  // (at 4 MiB only with the kept inputs in RAM)
    }
  }
}

// Explicit flags win over auto, flag by flag.
TEST_F(PlanAutoCli, ExplicitFlagsWin) {
  fs::create_directories(dir_ / "nvme");
  const json j = plan_json(auto_plan() + "--offload-params nvme --checkpoint-activations full --nvme-bw 1 --nvme-path " +
                           (dir_ / "nvme").string());
  ASSERT_TRUE(j.contains("auto")) << j.dump();
  for (const json& c : j["auto"]["fitting"]) {
    EXPECT_EQ(c["params"], "nvme");
    EXPECT_EQ(c["checkpointing"], "full");
  }
  EXPECT_GE(j["nvme_budget_bytes"].get<uint64_t>(), j["params_bytes"].get<uint64_t>()) << "the params live on NVMe";
  EXPECT_EQ(j["auto"]["fitting"][0]["grads"], "none") << "the rest all-resident, memory being ample";
}

// Nothing fits: one line naming the budgets and the closest placement, a non-zero exit.
TEST_F(PlanAutoCli, NothingFitsIsAnError) {
  const strata::test::CliResult r = strata::test::run_strata(dir_, auto_plan() + "--device-mem 1M --host-mem 1M");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--offload auto: none of the 40 placements fits device memory 1.00 MiB"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("the closest: "), std::string::npos) << r.err;
}

// `--optimizer-on-device auto` (Twin-Flow) on a modeled GPU: every split at a unit boundary
// predicted from one probe, from none of AdamW on the device to all of it; the pick is the fastest
// that fits the device budget, and with a budget between the two ends the splits past it are
// refused and the pick still fits.
TEST_F(PlanCli, TwinFlowAutoPicksTheFastestSplitThatFits) {
  const std::string args = plan("tiny") + "--backend cuda --gpu h100 --dtype bf16 --offload-optimizer cpu "
                                          "--optimizer-on-device auto";
  const json all = plan_json(args);
  ASSERT_TRUE(all.contains("twin")) << all.dump();
  const json& rows = all["twin"]["rows"];
  ASSERT_GE(rows.size(), 3u);
  EXPECT_EQ(rows.front()["optimizer_on_device"], "0");
  EXPECT_EQ(rows.back()["optimizer_on_device"], "1");
  EXPECT_DOUBLE_EQ(rows.back()["share"].get<double>(), 1.0);
  for (size_t k = 1; k < rows.size(); ++k) {
    EXPECT_GE(rows[k]["share"].get<double>(), rows[k - 1]["share"].get<double>());
    EXPECT_GE(rows[k]["device_bytes"].get<uint64_t>(), rows[k - 1]["device_bytes"].get<uint64_t>());
  }
  const auto check_pick = [](const json& j) {
    double best = 1e300;
    for (const json& r : j["twin"]["rows"])
      if (r["fits"].get<bool>()) best = std::min(best, r["predicted_step_ms"].get<double>());
    EXPECT_DOUBLE_EQ(j["predicted_step_ms"].get<double>(), best);
    EXPECT_LE(j["device_budget_bytes"].get<uint64_t>(), j["twin"]["device_budget_bytes"].get<uint64_t>());
  };
  check_pick(all);
  EXPECT_GT(all["adamw_device_ms"].get<double>() + (all["optimizer_on_device"] == "1" ? 1 : 0), 0) << all.dump();
  // A budget halfway between the two ends.
  const uint64_t lo = rows.front()["device_bytes"], hi = rows.back()["device_bytes"];
  ASSERT_GT(hi, lo);
  const json mid = plan_json(args + " --device-mem " + std::to_string((lo + hi) / 2));
  ASSERT_TRUE(mid.contains("twin")) << mid.dump();
  check_pick(mid);
  EXPECT_FALSE(mid["twin"]["rows"].back()["fits"].get<bool>());
  EXPECT_NE(mid["optimizer_on_device"], "1");
  // The fraction picked, given by hand, plans the same pools and bytes (the step is another
  // probe of this CPU's AdamW rate).
  const json again = plan_json(plan("tiny") + "--backend cuda --gpu h100 --dtype bf16 --offload-optimizer cpu "
                                              "--optimizer-on-device " + mid["optimizer_on_device"].get<std::string>() +
                               " --device-mem " + std::to_string((lo + hi) / 2));
  for (const char* key : {"device_budget_bytes", "host_budget_bytes", "h2d_bytes", "d2h_bytes"})
    EXPECT_EQ(again[key], mid[key]) << key;
}

// On the CPU backend there is nothing to split (AdamW runs on the same cores either way): auto is
// 0, said so, in a plan and in a run's header.
TEST_F(PlanCli, TwinFlowAutoIsNoneOnTheCpuBackend) {
  const std::string flags = " --offload-optimizer cpu --optimizer-on-device auto";
  const strata::test::CliResult p = strata::test::run_strata(dir_, plan("tiny") + flags);
  ASSERT_EQ(p.status, 0) << p.err;
  EXPECT_NE(p.out.find("optimizer on device auto: 0 (on the CPU backend"), std::string::npos) << p.out;
  const strata::test::CliResult t = strata::test::run_strata(
      dir_, "train --model " + (dir_ / "tiny").string() + " --threads 1 --seq 16 --batch 1 --steps 1" + flags);
  ASSERT_EQ(t.status, 0) << t.err;
  EXPECT_NE(t.out.find("optimizer on device auto: 0 (on the CPU backend"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("--optimizer-on-device 0 "), std::string::npos) << "the flags line holds the pick: " << t.out;
}

// With the optimizer on the CPU beside a GPU, the update runs beside the next forward when it
// waits for the norm, and beside the last backward (longer: twice the FLOPs) when each unit
// updates as its gradient is final (--grad-clip 0): the plan says which, and the window it hides
// behind is the longer one.
TEST_F(PlanCli, CpuAdamWHidesBehindTheBackwardWithoutClipping) {
  const std::string args = plan("tiny") + "--backend cuda --gpu h100 --dtype bf16 --offload-optimizer cpu ";
  const json clip = plan_json(args + "--grad-clip 1"), free = plan_json(args + "--grad-clip 0");
  ASSERT_TRUE(clip.contains("adamw_window_compute_ms") && free.contains("adamw_window_compute_ms"));
  EXPECT_GT(free["adamw_window_compute_ms"].get<double>(), 1.5 * clip["adamw_window_compute_ms"].get<double>());
  EXPECT_NEAR(clip["adamw_window_compute_ms"].get<double>(), 4 * clip["block_forward_ms"].get<double>(), 1e-9)
      << "the first forward of the tiny model's 4 layers";
  const strata::test::CliResult r = strata::test::run_strata(dir_, args + "--grad-clip 0");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("AdamW in the backward (no clipping)"), std::string::npos) << r.out;
}

// Each phase's achieved rate, and its share of the device's peak where the peak is known: a
// modeled GPU runs every phase at the stated efficiency; on the CPU backend no peak is claimed.
TEST_F(PlanCli, ReportsEachPhasesRateAndShareOfThePeak) {
  const json g = plan_json(plan("tiny") + "--backend cuda --gpu h200 --dtype bf16");
  ASSERT_TRUE(g.contains("phase_peak_fraction")) << g.dump();
  for (const char* phase : {"block_forward", "block_backward", "edge"}) {
    EXPECT_NEAR(g["phase_peak_fraction"][phase].get<double>(), strata::kModeledMfu, 1e-9) << phase;
    EXPECT_NEAR(g["phase_tflops"][phase].get<double>(), 989 * strata::kModeledMfu, 1e-6) << phase;
  }
  const json c = plan_json(plan("tiny"));
  EXPECT_FALSE(c.contains("phase_peak_fraction"));
  // (Probed: a phase the tiny model's probe times as a difference can come out 0 under load.)
  for (const char* phase : {"block_forward", "block_backward", "edge"}) EXPECT_GE(c["phase_tflops"][phase].get<double>(), 0);
  const strata::test::CliResult r = strata::test::run_strata(dir_, plan("tiny") + "--backend cuda --gpu h200 --dtype bf16");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("phases: block forward "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("37.6% of peak"), std::string::npos) << r.out;
}

// A split given with --offload auto applies where the pick offloads the optimizer, and is
// dropped (not an error) where the pick keeps it on the device.
TEST_F(PlanAutoCli, ASplitGivenWithAutoIsKeptOnlyWhereTheOptimizerIsOffloaded) {
  const json ample = plan_json(auto_plan() + "--optimizer-on-device 0.5");
  ASSERT_TRUE(ample.contains("auto")) << ample.dump();
  EXPECT_EQ(ample["auto"]["fitting"][0]["optimizer"], "none");
  EXPECT_EQ(ample["optimizer_on_device"], "0");
  const json cpu = plan_json(auto_plan() + "--offload-optimizer cpu --optimizer-on-device 0.5");
  ASSERT_TRUE(cpu.contains("auto")) << cpu.dump();
  EXPECT_EQ(cpu["optimizer_on_device"], "0.5");
}

// The replay with the disk's traffic taking the cores (--io-interference, else probed with the
// bandwidth): compute slows where the disk moves bytes, the disk where compute runs, and the
// output says by how much; 1,1 slows nothing, and --nvme-bw alone (no probe) assumes nothing.
TEST_F(PlanCli, TheReplaySlowsComputeAndTheDiskBesideEachOther) {
  fs::create_directories(dir_ / "nvme");
  const std::string nvme = plan("tiny") + "--host-mem 3M --offload-params nvme --offload-grads nvme "
                           "--offload-optimizer nvme --nvme-path " + (dir_ / "nvme").string() + " ";
  const json none = plan_json(nvme + "--nvme-bw 1");
  EXPECT_EQ(none["compute_beside_nvme"], 1.0);
  EXPECT_EQ(none["nvme_beside_compute"], 1.0);
  EXPECT_EQ(none["replayed_slowed_ms"], 0.0);
  const json ones = plan_json(nvme + "--nvme-bw 1 --io-interference 1,1");
  EXPECT_EQ(ones["replayed_slowed_ms"], 0.0);
  const json half = plan_json(nvme + "--nvme-bw 1 --io-interference 0.5,0.25");
  EXPECT_EQ(half["compute_beside_nvme"], 0.5);
  EXPECT_EQ(half["nvme_beside_compute"], 0.25);
  EXPECT_GT(half["replayed_slowed_ms"].get<double>(), 0);
  EXPECT_GT(half["replayed_nvme_overlapped"].get<double>(), 0);
  // The disk at a quarter of its speed beside compute: its busy time is its bytes at the rate
  // the settled overlap leaves it (within the replay's settling tolerance).
  const double bytes_ms = half["nvme_ms"].get<double>(), share = half["replayed_nvme_overlapped"].get<double>();
  EXPECT_NEAR(half["replayed_nvme_busy_ms"].get<double>() * (1 - share * 0.75), bytes_ms, 0.05 * bytes_ms);
  const strata::test::CliResult text = strata::test::run_strata(dir_, nvme + "--nvme-bw 1 --io-interference 0.5,0.25");
  EXPECT_NE(text.out.find("the disk's traffic taking the cores: compute runs at 50% beside the disk and the disk at "
                          "25% beside compute (--io-interference)"),
            std::string::npos)
      << text.out;
  // Probed with the bandwidth on the --nvme-path.
  const json probed = plan_json(nvme);
  for (const char* k : {"compute_beside_nvme", "nvme_beside_compute"}) {
    EXPECT_GT(probed[k].get<double>(), 0) << k;
    EXPECT_LE(probed[k].get<double>(), 1) << k;
  }
}
