// The placement invariant (DESIGN.md "Placement never changes the math"): on the CPU backend,
// every combination of --offload-params/grads/optimizer/activations, activation checkpointing
// and budgets from the minimum to ample gives bitwise the same per-step losses, grad norms and
// saved weights as the all-in-memory run; budgets below the minimum fail before step 1 naming
// it, and the minimum itself runs.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "offload/residency.h"
#include "offload/size.h"
#include "src/checkpoint/hf.h"
#include "src/train/speculation_trial.h"
#include "src/train/trainer.h"
#include "src/zero/unit_table.h"

using namespace strata;
namespace fs = std::filesystem;

namespace {

class TempDir {
 public:
  TempDir() {
    std::string t = (fs::path(::testing::TempDir()) / "strata_place_XXXXXX").string();
    EXPECT_NE(::mkdtemp(t.data()), nullptr);
    path_ = t;
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

ModelConfig tiny_llama() {
  ModelConfig c = default_model_config();
  c.hidden_size = 32;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 8;
  c.intermediate_size = 64;
  c.max_position_embeddings = 64;
  return c;
}

struct Outcome {
  std::vector<double> loss, norm;
  std::string weights;  // the saved model.safetensors, byte for byte
};

Outcome train(const TrainOptions& o, const fs::path& out) {
  Trainer t(o);
  Outcome r;
  for (int64_t i = 0; i < o.steps; ++i) {
    const StepStats st = t.step();
    r.loss.push_back(st.loss);
    r.norm.push_back(st.grad_norm);
  }
  t.save(out.string());
  r.weights = slurp(out / "model.safetensors");
  return r;
}

// Bitwise the reference run: every step's loss and grad norm, and the saved weights; no swap
// file left behind.
void expect_same_run(const Outcome& got, const Outcome& ref, const fs::path& swap) {
  ASSERT_EQ(got.loss.size(), ref.loss.size());
  for (size_t s = 0; s < ref.loss.size(); ++s) {
    EXPECT_EQ(got.loss[s], ref.loss[s]) << "step " << s + 1;
    if (!std::isnan(got.norm[s]) || !std::isnan(ref.norm[s])) {  // (an fp16 overflow's norm is NaN in both)
      EXPECT_EQ(got.norm[s], ref.norm[s]) << "step " << s + 1;
    }
  }
  EXPECT_TRUE(got.weights == ref.weights) << "saved weights differ";
  EXPECT_TRUE(fs::is_empty(swap)) << "swap files left behind";
}

// Three steps of the model in `dir` (swap files under dir/swap), all in memory.
TrainOptions three_steps(const fs::path& dir, const char* dtype, int64_t accum) {
  TrainOptions o;
  o.model = dir.string();
  o.dtype = dtype;
  o.batch = 2, o.seq = 16, o.grad_accum = accum, o.steps = 3, o.warmup = 1, o.lr = 3e-3;
  o.nvme_paths = {(dir / "swap").string()};
  return o;
}

struct Combo {
  std::string params, grads, optimizer, ckpt, acts;
  int budget;  // 0: minimum, 1: between, 2: ample (automatic)
};

TEST(Placement, EveryCombinationIsBitwiseTheAllInMemoryRun) {
  TempDir dir;
  write_hf_config(tiny_llama(), dir.path() / "config.json");
  fs::create_directories(dir.path() / "swap");
  const std::vector<std::string> where = {"none", "cpu", "nvme"}, ckpts = {"none", "full", "every:2"};
  // Every value of every flag appears (the first three combos), the rest sampled with a fixed seed.
  std::vector<Combo> combos = {{"none", "cpu", "nvme", "full", "cpu", 0},
                               {"cpu", "nvme", "none", "every:2", "nvme", 1},
                               {"nvme", "none", "cpu", "none", "none", 2},
                               {"nvme", "nvme", "nvme", "full", "nvme", 0}};
  std::mt19937 rng(2024);
  for (int i = 0; i < 4; ++i) {
    Combo c{where[rng() % 3], where[rng() % 3], where[rng() % 3], ckpts[rng() % 3], "none", static_cast<int>(rng() % 3)};
    if (c.ckpt != "none") c.acts = where[rng() % 3];
    combos.push_back(c);
  }
  int n_run = 0;
  for (const char* dtype : {"fp32", "bf16"}) {
    for (int64_t accum : {1, 2}) {
      const TrainOptions base = three_steps(dir.path(), dtype, accum);
      const Outcome ref = train(base, dir.path() / "ref");
      ASSERT_EQ(ref.loss.size(), 3u);
      for (size_t ci = 0; ci < combos.size(); ++ci) {
        // Half the combos per (dtype, accum): all of them across the four.
        if ((ci + static_cast<size_t>(accum) + (dtype[0] == 'b' ? 1 : 0)) % 2) continue;
        const Combo& c = combos[ci];
        TrainOptions o = base;
        o.offload_params = c.params, o.offload_grads = c.grads, o.offload_optimizer = c.optimizer;
        o.checkpoint_activations = c.ckpt, o.offload_activations = c.acts;
        const std::string what = std::string(dtype) + " accum " + std::to_string(accum) + " params " + c.params +
                                 " grads " + c.grads + " optimizer " + c.optimizer + " ckpt " + c.ckpt + " acts " +
                                 c.acts + " budget " + std::to_string(c.budget);
        SCOPED_TRACE(what);
        if (c.budget < 2) {  // the host budget from its minimum up (the device keeps what it holds)
          const RunPlan p = plan_run(o, /*minimums=*/true);
          const uint64_t lo = p.memory.minimum[1], hi = p.memory.working_set[1];
          ASSERT_GT(hi, 0u);
          const uint64_t host = c.budget == 0 ? lo : (lo + hi) / 2;
          o.host_mem = std::to_string(std::max<uint64_t>(host, offload::kAlign));
        }
        expect_same_run(train(o, dir.path() / ("out" + std::to_string(n_run++))), ref, dir.path() / "swap");
      }
    }
  }
  EXPECT_GE(n_run, 16);
}

// With no clipping (one rank, no fp16 loss scaler) each unit's AdamW runs in the backward as
// soon as its gradient is final. The math must not move by a bit: losses, norms and saved
// weights equal the run that updates inside the next forward, in memory and offloaded, fp32 and
// bf16, with and without accumulation, tied and untied heads.
TEST(Placement, UpdateInTheBackwardIsBitwiseTheUpdateInTheNextForward) {
  int n_run = 0;
  for (bool tied : {false, true}) {
    TempDir dir;
    ModelConfig cfg = tiny_llama();
    cfg.tie_word_embeddings = tied;
    write_hf_config(cfg, dir.path() / "config.json");
    fs::create_directories(dir.path() / "swap");
    for (const char* dtype : {"fp32", "bf16"}) {
      for (int64_t accum : {1, 2}) {
        TrainOptions base = three_steps(dir.path(), dtype, accum);
        base.grad_clip = 0;
        TrainOptions next_forward = base;
        next_forward.update_in_backward = false;
        ASSERT_FALSE(plan_run(next_forward).update_in_backward);
        const Outcome ref = train(next_forward, dir.path() / "ref");
        for (int placement = 0; placement < 3; ++placement) {
          TrainOptions o = base;
          if (placement == 1) {  // everything on NVMe, at the host minimum
            o.offload_params = o.offload_grads = o.offload_optimizer = "nvme";
            o.checkpoint_activations = "full", o.offload_activations = "cpu";
            o.host_mem = std::to_string(plan_run(o, /*minimums=*/true).memory.minimum[1]);
          } else if (placement == 2) {
            o.offload_params = "cpu", o.offload_optimizer = "nvme", o.checkpoint_activations = "every:2";
          }
          SCOPED_TRACE(std::string(dtype) + " accum " + std::to_string(accum) + (tied ? " tied" : " untied") +
                       " placement " + std::to_string(placement));
          ASSERT_TRUE(plan_run(o).update_in_backward);
          expect_same_run(train(o, dir.path() / ("out" + std::to_string(n_run++))), ref, dir.path() / "swap");
        }
      }
    }
  }
  EXPECT_EQ(n_run, 24);
}

// Only where nothing waits for the global norm and grads are whole: clipping on, fp16 (its loss
// scaler skips steps that overflow) or ZeRO stages 2-3 keep the update in the next forward.
TEST(Placement, UpdateStaysInTheNextForwardWhenTheNormDecides) {
  TempDir dir;
  write_hf_config(tiny_llama(), dir.path() / "config.json");
  TrainOptions o;
  o.model = dir.path().string();
  o.batch = 2, o.seq = 16, o.grad_clip = 0;
  EXPECT_TRUE(plan_run(o).update_in_backward);
  EXPECT_TRUE(plan_run(o, false, /*world=*/2).update_in_backward);  // stage 0: whole grads, summed
  o.zero_stage = 1;
  EXPECT_TRUE(plan_run(o, false, 2).update_in_backward);
  o.zero_stage = 2;  // reduce-scattered into shards
  EXPECT_FALSE(plan_run(o, false, 2).update_in_backward);
  o.zero_stage = 0;
  o.dtype = "fp16";
  EXPECT_FALSE(plan_run(o).update_in_backward);
  o.dtype = "bf16", o.grad_clip = 1;
  EXPECT_FALSE(plan_run(o).update_in_backward);
}

// --speculate: with clipping on (and fp16's overflow check), each unit's AdamW runs in the
// backward with clip coefficient 1 into a second copy of its state, kept when the norm agrees
// and redone from the first copy otherwise. Bitwise the run whose update waits for the norm, for
// steps that clip, steps that do not and fp16 overflow steps; in memory and offloaded, every
// dtype, accumulation 1 and 2; and with auto's switches between speculating steps and steps
// that wait for the norm after a rollback.
TEST(Placement, SpeculationIsBitwiseTheUpdateThatWaitsForTheNorm) {
  TempDir dir;
  write_hf_config(tiny_llama(), dir.path() / "config.json");
  fs::create_directories(dir.path() / "swap");
  struct Run {
    Outcome out;
    std::vector<bool> rolled_back, skipped, speculated;
  };
  const auto run = [&](const TrainOptions& o, const fs::path& out) {
    Trainer t(o);
    Run r;
    for (int64_t i = 0; i < o.steps; ++i) {
      const StepStats st = t.step();
      r.out.loss.push_back(st.loss);
      r.out.norm.push_back(st.grad_norm);
      r.rolled_back.push_back(st.rolled_back);
      r.skipped.push_back(st.skipped);
      r.speculated.push_back(st.speculated);
      // on: every step; auto: a step after a rollback waits for the norm, then two, ...
      bool expected = o.speculate != "off";
      if (o.speculate == "auto") {
        int64_t wait = 0, backoff = 1;
        for (size_t k = 0; k + 1 < r.rolled_back.size(); ++k)
          if (wait > 0) {
            --wait;
          } else {
            wait = r.rolled_back[k] ? backoff : 0;
            backoff = r.rolled_back[k] ? 2 * backoff : 1;
          }
        expected = wait == 0;
      }
      EXPECT_EQ(st.speculated, expected) << "step " << i + 1;
    }
    t.save(out.string());
    r.out.weights = slurp(out / "model.safetensors");
    return r;
  };
  int n_run = 0, mixed = 0, overflows = 0, waited = 0;
  for (const char* dtype : {"fp32", "bf16", "fp16"}) {
    for (int64_t accum : {1, 2}) {
      TrainOptions base = three_steps(dir.path(), dtype, accum);
      base.steps = 5;
      if (std::string(dtype) == "fp16") base.loss_scale = 1 << 20;  // fp16: some steps overflow
      base.speculate = "off";
      // Clip thresholds: below every norm, between them (the unclipped run's median), above all.
      std::vector<double> norms = train(base, dir.path() / "probe").norm;
      std::vector<double> finite;
      for (double x : norms)
        if (std::isfinite(x)) finite.push_back(x);
      ASSERT_FALSE(finite.empty());
      std::sort(finite.begin(), finite.end());
      for (double clip : {1e-3, finite[finite.size() / 2], 1e9}) {
        TrainOptions off = base;
        off.grad_clip = clip;
        const Run ref = run(off, dir.path() / "ref");
        for (int placement = 0; placement < 3; ++placement) {
          TrainOptions o = off;
          o.speculate = placement == 2 ? "auto" : "on";  // auto: backs off after rollbacks
          o.speculate_trial = 0;  // (auto's trial has its own test: here it speculates from the start)
          if (placement == 2) o.offload_optimizer = "nvme", o.offload_grads = "nvme";
          if (placement == 1) {  // everything on NVMe at speculation's host minimum
            o.offload_params = o.offload_grads = o.offload_optimizer = "nvme";
            o.checkpoint_activations = "full", o.offload_activations = "cpu";
            o.host_mem = std::to_string(plan_run(o, /*minimums=*/true).memory.minimum[1]);
          }
          SCOPED_TRACE(std::string(dtype) + " accum " + std::to_string(accum) + " clip " + std::to_string(clip) +
                       " placement " + std::to_string(placement));
          ASSERT_TRUE(plan_run(o).update_in_backward);
          const Run got = run(o, dir.path() / ("out" + std::to_string(n_run++)));
          expect_same_run(got.out, ref.out, dir.path() / "swap");
          EXPECT_EQ(got.skipped, ref.skipped);
          int rolled = 0;
          for (size_t k = 0; k < got.rolled_back.size(); ++k) {
            rolled += got.rolled_back[k];
            // Rolled back exactly where the norm clips or the step is not applied.
            const bool clips = clip / (ref.out.norm[k] + 1e-6) < 1.0;
            EXPECT_EQ(got.rolled_back[k],
                      got.speculated[k] && (ref.skipped[k] || !std::isfinite(ref.out.norm[k]) || clips))
                << "step " << k + 1;
            overflows += ref.skipped[k];
          }
          if (clip == 1e-3) {
            EXPECT_EQ(rolled, placement == 2 ? 2 : 5);  // auto: steps 1 and 3 (then waits 1, 2)
          }
          waited += placement == 2 && rolled > 0;
          if (rolled > 0 && rolled < 5) ++mixed;
        }
      }
    }
  }
  EXPECT_EQ(n_run, 54);
  EXPECT_GT(waited, 0);
  EXPECT_GT(mixed, 0) << "no run had both steps that clip and steps that do not";
  EXPECT_GT(overflows, 0) << "no fp16 step overflowed";
}

// Twin-Flow (--optimizer-on-device): part of the master and AdamW state stays on the device and
// updates there, the rest on --offload-optimizer's tier. The math must not move by a bit: every
// split, with the rest in RAM or on NVMe (at the host minimum too), fp32 and bf16, accumulation 1
// and 2, with speculation, is bitwise the all-in-memory run. Under STRATA_FAULT=separate-optimizer
// (ctest two_runtime_placement) the CPU's part runs on a runtime and stream of its own, as on a
// GPU, while the device's part runs on the compute stream.
TEST(Placement, TwinFlowIsBitwiseTheOptimizerOnEitherSide) {
  TempDir dir;
  write_hf_config(tiny_llama(), dir.path() / "config.json");
  fs::create_directories(dir.path() / "swap");
  int n_run = 0;
  for (const char* dtype : {"fp32", "bf16"}) {
    for (int64_t accum : {1, 2}) {
      const TrainOptions base = three_steps(dir.path(), dtype, accum);
      const Outcome ref = train(base, dir.path() / "ref");
      for (const char* where : {"cpu", "nvme"}) {
        for (const char* fraction : {"0", "0.3", "0.7", "1"}) {
          TrainOptions o = base;
          o.offload_optimizer = where;
          o.optimizer_on_device = fraction;
          const bool low = n_run % 3 == 1;  // some at the host minimum
          const bool spec = n_run % 4 == 2;  // some speculative, with a clip that binds at step 1
          if (spec) o.speculate = "on", o.grad_clip = 0.5;
          SCOPED_TRACE(std::string(dtype) + " accum " + std::to_string(accum) + " optimizer " + where +
                       " on device " + fraction + (low ? " host minimum" : "") + (spec ? " speculative" : ""));
          const RunPlan p = plan_run(o, /*minimums=*/true);
          // The split is real: master and AdamW state on both tiers except at 0 and 1.
          const auto& homed = p.memory.homed;
          const uint64_t on_dev = homed[0][static_cast<size_t>(Role::master)];
          const uint64_t off_dev = homed[1][static_cast<size_t>(Role::master)] + homed[2][static_cast<size_t>(Role::master)];
          EXPECT_EQ(on_dev > 0, std::string(fraction) != "0");
          EXPECT_EQ(off_dev > 0, std::string(fraction) != "1");
          if (low) o.host_mem = std::to_string(std::max<uint64_t>(p.memory.minimum[1], offload::kAlign));
          const Outcome ref_spec = spec ? [&] {
            TrainOptions r = base;
            r.grad_clip = 0.5;
            return train(r, dir.path() / ("ref_spec" + std::to_string(n_run)));
          }() : ref;
          expect_same_run(train(o, dir.path() / ("twin" + std::to_string(n_run++))), ref_spec, dir.path() / "swap");
        }
      }
    }
  }
  EXPECT_EQ(n_run, 32);
}

// The units Twin-Flow keeps on the device: trainable and held ones in forward order, within the
// fraction; frozen units and another stage's are skipped, not counted.
TEST(Placement, TwinFlowTakesTheFirstTrainableUnitsWithinTheFraction) {
  std::vector<Unit> units(5);
  const int64_t numel[] = {40, 10, 10, 30, 10};
  for (size_t u = 0; u < units.size(); ++u) units[u].numel = numel[u], units[u].held = true;
  units[4].held = false;  // another pipeline stage's
  const std::vector<bool> trains = {true, false, true, true, true};
  using V = std::vector<bool>;
  // Trainable and held: 40 + 10 + 30 = 80 elements.
  EXPECT_EQ(twin_device_units(units, trains, 0), V(5, false));
  EXPECT_EQ(twin_device_units(units, trains, 0.49), V(5, false));  // 40 > 39.2
  EXPECT_EQ(twin_device_units(units, trains, 0.5), (V{true, false, false, false, false}));
  EXPECT_EQ(twin_device_units(units, trains, 0.624), (V{true, false, false, false, false}));
  EXPECT_EQ(twin_device_units(units, trains, 0.625), (V{true, false, true, false, false}));
  EXPECT_EQ(twin_device_units(units, trains, 0.99), (V{true, false, true, false, false}));
  EXPECT_EQ(twin_device_units(units, trains, 1), (V{true, false, true, true, false}));
}

// On a GPU (planned here, nothing run) the device's part updates where its state is: only the
// CPU's part crosses PCIe (its gradients down, its new weights up), so the bytes fall with the
// fraction and are none at 1, as with --offload-optimizer none.
TEST(Placement, TwinFlowMovesOnlyTheCpuPartOverPcie) {
  TempDir dir;
  write_hf_config(tiny_llama(), dir.path() / "config.json");
  TrainOptions o = three_steps(dir.path(), "bf16", 1);
  o.backend = "cuda";
  o.offload_optimizer = "cpu";
  std::vector<uint64_t> d2h, h2d;
  for (const char* fraction : {"0", "0.5", "1"}) {
    o.optimizer_on_device = fraction;
    const RunPlan p = plan_run(o);
    d2h.push_back(p.memory.link_bytes[static_cast<size_t>(offload::Link::d2h)]);
    h2d.push_back(p.memory.link_bytes[static_cast<size_t>(offload::Link::h2d)]);
  }
  EXPECT_GT(d2h[0], d2h[1]);
  EXPECT_GT(d2h[1], 0u);
  EXPECT_EQ(d2h[2], 0u);
  EXPECT_GT(h2d[0], h2d[1]);
  EXPECT_GT(h2d[1], 0u);
  EXPECT_EQ(h2d[2], 0u);
}

TEST(Placement, TwinFlowNeedsTheOptimizerOffTheDeviceAndAFraction) {
  TempDir dir;
  write_hf_config(tiny_llama(), dir.path() / "config.json");
  TrainOptions o = three_steps(dir.path(), "fp32", 1);
  for (const char* bad : {"1.5", "-0.1", "abc", "nan", "", "0.5x", "inf"}) {
    o.optimizer_on_device = bad;
    try {
      validate_options(o);
      ADD_FAILURE() << "accepted --optimizer-on-device '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--optimizer-on-device"), std::string::npos) << e.what();
    }
  }
  o.optimizer_on_device = "0.5";  // with --offload-optimizer none: nothing to split
  try {
    plan_run(o);
    ADD_FAILURE() << "accepted a split with --offload-optimizer none";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--offload-optimizer cpu or nvme"), std::string::npos) << e.what();
  }
  for (const char* fine : {"0", "1"}) {  // none and all: the optimizer is on the device either way
    o.optimizer_on_device = fine;
    EXPECT_NO_THROW(plan_run(o));
  }
}

// Speculation needs whole gradients: refused at ZeRO stages 2-3 when asked for, off where
// nothing waits for the norm, and auto turns it on only where the optimizer state is on NVMe.
TEST(Placement, SpeculationIsOnlyWhereTheNormWaitsAndGradsAreWhole) {
  TempDir dir;
  write_hf_config(tiny_llama(), dir.path() / "config.json");
  TrainOptions o;
  o.model = dir.path().string();
  o.batch = 2, o.seq = 16;
  o.nvme_paths = {(dir.path() / "swap").string()};
  EXPECT_FALSE(plan_run(o).update_in_backward);  // off by default
  o.speculate = "auto";
  EXPECT_FALSE(plan_run(o).update_in_backward);  // auto, optimizer on the device: waits for the norm
  o.speculate = "on";
  EXPECT_TRUE(plan_run(o).update_in_backward);
  o.speculate = "auto", o.offload_optimizer = "nvme";
  EXPECT_TRUE(plan_run(o).update_in_backward);
  o.speculate = "off";
  EXPECT_FALSE(plan_run(o).update_in_backward);
  o.speculate = "on", o.zero_stage = 2;
  try {
    plan_run(o, false, /*world=*/2);
    ADD_FAILURE() << "--speculate on at stage 2 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--speculate on needs whole gradients"), std::string::npos) << e.what();
  }
  o.speculate = "auto";
  EXPECT_FALSE(plan_run(o, false, 2).update_in_backward);  // auto steps aside at stage 2
  o.zero_stage = 1;
  EXPECT_TRUE(plan_run(o, false, 2).update_in_backward);
  // Below what its second copies need, auto runs without them (the minimum named is that run's),
  // and `on` is refused.
  o.zero_stage = 0, o.offload_params = o.offload_grads = "nvme";
  const uint64_t plain_minimum = plan_run(o, true).memory.minimum[1];
  o.speculate = "on";
  const uint64_t spec_minimum = plan_run(o, true).memory.minimum[1];
  EXPECT_LT(plain_minimum, spec_minimum);
  o.host_mem = std::to_string(plain_minimum);
  EXPECT_THROW(plan_run(o), offload::BudgetError);
  o.speculate = "auto";
  EXPECT_FALSE(plan_run(o).speculate);
  o.host_mem = std::to_string(spec_minimum);
  EXPECT_TRUE(plan_run(o).speculate);
  o.host_mem.clear();
  o.speculate = "maybe";
  EXPECT_THROW(plan_run(o), std::invalid_argument);
  o.speculate = "auto";
  for (int64_t bad : {-1, 1, 1001}) {
    o.speculate_trial = bad;
    EXPECT_THROW(plan_run(o), std::invalid_argument) << bad;
  }
}

// The trial's arithmetic on given step times: each way's first step is left out, a gain under
// kMinGain waits, another rank's verdict replaces this one's.
TEST(SpeculationTrial, LeavesOutEachWaysFirstStepAndWantsAClearGain) {
  SpeculationTrial t(3);
  const double times[] = {500, 100, 110, 40, 120, 130};  // speculating 105 against waiting 125
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(t.deciding());
    EXPECT_EQ(t.speculate_next(), i < 3) << i;
    EXPECT_EQ(t.record(times[i]), i == 5) << i;
  }
  EXPECT_FALSE(t.deciding());
  EXPECT_DOUBLE_EQ(t.speculating_ms(), 105);
  EXPECT_DOUBLE_EQ(t.waiting_ms(), 125);
  EXPECT_TRUE(t.verdict());
  EXPECT_FALSE(t.record(1));  // decided: steps no longer count
  EXPECT_DOUBLE_EQ(t.speculating_ms(), 105);
  t.agree(false);
  EXPECT_FALSE(t.verdict());

  SpeculationTrial close(2);  // 99 against 100: under 2%, it waits
  for (double ms : {1.0, 99.0, 1.0, 100.0}) close.record(ms);
  EXPECT_FALSE(close.verdict());
  SpeculationTrial slower(2);
  for (double ms : {1.0, 200.0, 1.0, 100.0}) slower.record(ms);
  EXPECT_FALSE(slower.verdict());
  EXPECT_DOUBLE_EQ(slower.speculating_ms(), 200);
}

// --speculate auto's trial: the first --speculate-trial steps speculate, as many wait for the
// norm, and the step that ends it carries each way's mean over its timed steps (the first of
// each left out) and the verdict, which the rest of the run follows; bitwise the run that never
// speculates, whichever way it goes, and with steps that clip (rolled back in the trial, each
// rerun counted in its step's time).
TEST(Placement, SpeculateAutoTimesBothWaysThenKeepsTheFaster) {
  TempDir dir;
  write_hf_config(tiny_llama(), dir.path() / "config.json");
  fs::create_directories(dir.path() / "swap");
  for (double clip : {1e9, 1e-3}) {
    TrainOptions off = three_steps(dir.path(), "fp32", 1);
    off.steps = 9;
    off.grad_clip = clip;
    off.offload_optimizer = "nvme";
    off.speculate = "off";
    const Outcome ref = train(off, dir.path() / "ref");
    TrainOptions o = off;
    o.speculate = "auto";
    o.speculate_trial = 3;
    SCOPED_TRACE("clip " + std::to_string(clip));
    auto t = std::make_unique<Trainer>(o);
    Outcome got;
    std::vector<double> ms;
    std::optional<StepStats::TrialVerdict> verdict;
    for (int64_t i = 0; i < o.steps; ++i) {
      const StepStats st = t->step();
      got.loss.push_back(st.loss);
      got.norm.push_back(st.grad_norm);
      ms.push_back(st.step_ms);
      EXPECT_EQ(st.speculation_trial.has_value(), i == 5) << "step " << i + 1;
      if (st.speculation_trial) verdict = st.speculation_trial;
      // Trial: steps 1-3 speculate, 4-6 wait; then the verdict (no clipping: no backoff).
      const bool expected = i < 3 || (i >= 6 && verdict && verdict->speculate && clip > 1);
      if (i < 6 || clip > 1) {
        EXPECT_EQ(st.speculated, expected) << "step " << i + 1;
      }
      if (i >= 6 && verdict && !verdict->speculate) {
        EXPECT_FALSE(st.speculated) << "step " << i + 1;
      }
      EXPECT_EQ(st.rolled_back, st.speculated && clip < 1) << "step " << i + 1;
    }
    ASSERT_TRUE(verdict.has_value());
    EXPECT_DOUBLE_EQ(verdict->speculating_ms, (ms[1] + ms[2]) / 2);
    EXPECT_DOUBLE_EQ(verdict->waiting_ms, (ms[4] + ms[5]) / 2);
    EXPECT_EQ(verdict->speculate, verdict->speculating_ms < verdict->waiting_ms * (1 - SpeculationTrial::kMinGain));
    t->save((dir.path() / "got").string());
    t.reset();  // (its swap files go with it)
    got.weights = slurp(dir.path() / "got" / "model.safetensors");
    expect_same_run(got, ref, dir.path() / "swap");
  }
}

// One step of tiny_llama, its config in `dir` and any swap files under dir/swap.
TrainOptions one_step_run(const TempDir& dir) {
  write_hf_config(tiny_llama(), dir.path() / "config.json");
  fs::create_directories(dir.path() / "swap");
  TrainOptions o;
  o.model = dir.path().string();
  o.batch = 2, o.seq = 16, o.steps = 1;
  o.nvme_paths = {(dir.path() / "swap").string()};
  return o;
}

// A host budget below the minimum fails before step 1, naming the tier and the minimum; the
// minimum named runs.
TEST(Placement, BudgetBelowMinimumNamesTheMinimumWhichRuns) {
  TempDir dir;
  TrainOptions o = one_step_run(dir);
  o.offload_optimizer = "nvme", o.offload_grads = "nvme";
  const uint64_t minimum = plan_run(o, true).memory.minimum[1];
  ASSERT_GT(minimum, offload::kAlign);
  o.host_mem = std::to_string(minimum - offload::kAlign);
  try {
    Trainer t(o);
    ADD_FAILURE() << "a host budget below the minimum was accepted";
  } catch (const offload::BudgetError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.tier(), offload::Tier::host) << msg;
    EXPECT_NE(msg.find("--host-mem"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::to_string(minimum)), std::string::npos) << msg;
  }
  o.host_mem = std::to_string(minimum);
  Trainer t(o);
  EXPECT_TRUE(std::isfinite(t.step().loss));
  EXPECT_LE(t.host_bytes(), minimum);
}

// The replayed step costs every phase once: each block's forward, its backward and (checkpointed)
// its recompute, the head and edges once per micro-batch, the Σg² once per step, and AdamW over
// every unit. With instant links nothing waits, so the step is exactly that sum.
TEST(Placement, ReplayedStepCostsEveryPhaseOnce) {
  TempDir dir;
  TrainOptions o = one_step_run(dir);
  o.offload_params = o.offload_grads = o.offload_optimizer = "nvme";
  o.checkpoint_activations = "every:2";
  o.grad_accum = 2;
  const RunPlan p = plan_run(o);
  StepCosts c;
  c.phases = {.block_forward_ms = 1, .block_backward_ms = 10, .edge_ms = 100, .sum_squares_ms = 1000,
              .edge_sum_squares_ms = 10000};
  const int64_t L = tiny_llama().n_layers;
  ASSERT_GE(L, 2);
  const double ckpt = static_cast<double>((L + 1) / 2);  // every:2 checkpoints layers 0, 2, ...
  const double phases = 2 * (100 + static_cast<double>(L) * (1 + 10) + ckpt * 1) + 10000 + static_cast<double>(L) * 1000;
  c.adamw_params_per_ms = 1e30;  // AdamW costs nothing
  offload::StepTimeline t = estimate_run(o, p, c);
  EXPECT_NEAR(t.compute_ms, phases, 1e-6);
  EXPECT_NEAR(t.step_ms, phases, 1e-6);  // links not modelled: nothing waits
  EXPECT_EQ(t.stall_ms, 0);
  c.adamw_params_per_ms = 1;  // one parameter per ms: AdamW adds every unit's padded size (m, v: 8 bytes)
  t = estimate_run(o, p, c);
  const uint64_t adam_bytes = p.memory.homed[offload::index(offload::Tier::nvme)][static_cast<size_t>(Role::adam)];
  ASSERT_GE(adam_bytes / 8, static_cast<uint64_t>(p.n_params));
  EXPECT_NEAR(t.compute_ms - phases, static_cast<double>(adam_bytes / 8), 1e-6);
}

// The norm barrier's bound: the update's NVMe reads and writes, less what the room left beside
// the home copies can hold at either end of the window, over each direction's rate.
TEST(Placement, BarrierBoundCountsTheUpdatesBytesBeyondTheRoom) {
  MemoryPlan mp;
  const auto nvme = offload::index(offload::Tier::nvme), host = offload::index(offload::Tier::host),
             device = offload::index(offload::Tier::device);
  mp.homed[nvme][static_cast<size_t>(Role::master)] = 100;
  mp.homed[nvme][static_cast<size_t>(Role::adam)] = 200;
  mp.homed[nvme][static_cast<size_t>(Role::grads)] = 50;
  mp.homed[nvme][static_cast<size_t>(Role::params)] = 25;
  mp.homed[nvme][static_cast<size_t>(Role::activations)] = 1000;  // checkpoints: not the update's
  mp.homed[host][kNumRoles] = 30;                            // host buffers: not room
  mp.budget[host] = 130;
  mp.homed[device][static_cast<size_t>(Role::activations)] = 5;
  mp.budget[device] = 45;
  const offload::LinkRates rates{.nvme_read = 10, .nvme_write = 5};
  BarrierBound b = barrier_bound(mp, kernels::Backend::cpu, 20, 7, rates);
  EXPECT_EQ(b.read_bytes, 350u);
  EXPECT_EQ(b.write_bytes, 325u);
  EXPECT_EQ(b.room, 100u);  // on the CPU only the host holds NVMe-homed copies
  EXPECT_DOUBLE_EQ(b.window_io_ms, (350 - 100) / 10.0 + (325 - 100) / 5.0);
  EXPECT_DOUBLE_EQ(b.step_ms, 7 + 70);
  EXPECT_DOUBLE_EQ(b.ms_per_gib, (1u << 30) / 10.0 + (1u << 30) / 5.0);
  b = barrier_bound(mp, kernels::Backend::cuda, 20, 7, rates);
  EXPECT_EQ(b.room, 140u);  // a GPU's free device memory holds copies too
  EXPECT_DOUBLE_EQ(b.window_io_ms, (350 - 140) / 10.0 + (325 - 140) / 5.0);
  b = barrier_bound(mp, kernels::Backend::cpu, 100, 7, rates);  // compute covers the window's I/O
  EXPECT_DOUBLE_EQ(b.step_ms, 107);
  EXPECT_EQ(b.ms_per_gib, 0);
  mp.budget[host] = 1000;  // room for everything: nothing has to move inside the window
  b = barrier_bound(mp, kernels::Backend::cpu, 20, 7, rates);
  EXPECT_EQ(b.window_io_ms, 0);
  EXPECT_DOUBLE_EQ(b.step_ms, 27);
}

// No schedule beats the bound, so neither may the replayed plan: all on NVMe, at the host
// minimum and with ample room, with each link slow enough to matter. Speculation is what lifts
// the bound: with it the update leaves the window and the replayed step beats it.
TEST(Placement, ReplayedStepNeverBeatsTheBarrierBound) {
  TempDir dir;
  TrainOptions o = one_step_run(dir);
  o.offload_params = o.offload_grads = o.offload_optimizer = "nvme";
  o.speculate = "off";
  o.checkpoint_activations = "full";
  StepCosts c;
  c.phases = {.block_forward_ms = 1, .block_backward_ms = 3, .edge_ms = 2, .sum_squares_ms = 0.1,
              .edge_sum_squares_ms = 0.2};
  c.adamw_params_per_ms = 1e30;
  const double window_ms = static_cast<double>(tiny_llama().n_layers) * c.phases.block_forward_ms;
  for (bool at_minimum : {false, true}) {
    if (at_minimum) o.host_mem = std::to_string(plan_run(o, true).memory.minimum[1]);
    const RunPlan p = plan_run(o);
    const auto& nvme = p.memory.homed[offload::index(offload::Tier::nvme)];
    const double update_bytes = static_cast<double>(nvme[static_cast<size_t>(Role::adam)]);
    ASSERT_GT(update_bytes, 0);
    for (double io_ms : {1.0, 10.0, 100.0}) {  // the moments alone take io_ms to read
      c.links.nvme_read = update_bytes / io_ms, c.links.nvme_write = update_bytes / io_ms;
      const offload::StepTimeline t = estimate_run(o, p, c);
      const BarrierBound b = barrier_bound(p.memory, kernels::Backend::cpu, window_ms, t.compute_ms - window_ms, c.links);
      if (at_minimum && io_ms == 100.0) {
        EXPECT_GT(b.window_io_ms, window_ms) << "the bound binds somewhere";
      }
      EXPECT_GE(t.step_ms, b.step_ms * (1 - 1e-9))
          << "host " << o.host_mem << ", io " << io_ms << " ms: window I/O " << b.window_io_ms << " ms, room "
          << b.room;
      if (at_minimum && io_ms == 100.0) {  // where the bound binds, speculation beats it
        TrainOptions spec = o;
        spec.speculate = "on", spec.host_mem.clear();
        const RunPlan sp = plan_run(spec);
        ASSERT_TRUE(sp.speculate);
        EXPECT_LT(estimate_run(spec, sp, c).step_ms, b.step_ms);
      }
    }
  }
}

// A budget too small for even its tier's home copies fails the same way: the error names the
// tier's minimum (not the home copy that overflowed it, which named a budget that failed again
// at the next), and the minimum named runs.
void expect_home_shortfall_names_the_minimum(TrainOptions o, offload::Tier tier) {
  const bool device = tier == offload::Tier::device;
  const char* const flag = device ? "--device-mem" : "--host-mem";
  std::string& mem = device ? o.device_mem : o.host_mem;
  const RunPlan ample = plan_run(o);
  uint64_t homed = 0;
  for (uint64_t b : ample.memory.homed[offload::index(tier)]) homed += b;
  ASSERT_GT(homed, offload::kAlign) << "the budget must be too small for the home copies";
  mem = std::to_string(offload::kAlign);
  uint64_t minimum = 0;
  try {
    Trainer t(o);
    ADD_FAILURE() << "a " << flag << " below the home copies was accepted";
  } catch (const offload::BudgetError& e) {
    const std::string msg = e.what();
    minimum = e.minimum();
    EXPECT_EQ(e.tier(), tier) << msg;
    EXPECT_EQ(e.budget(), offload::kAlign) << msg;
    EXPECT_GE(minimum, homed) << msg;
    EXPECT_NE(msg.find(flag), std::string::npos) << msg;
    EXPECT_NE(msg.find("(" + std::to_string(minimum) + " bytes)"), std::string::npos) << msg;
  }
  ASSERT_GT(minimum, 0u);
  mem = std::to_string(minimum);
  Trainer t(o);
  EXPECT_TRUE(std::isfinite(t.step().loss));
  EXPECT_LE(device ? t.device_bytes() : t.host_bytes(), minimum);
}

TEST(Placement, DeviceBudgetBelowItsHomeCopiesNamesTheMinimumWhichRuns) {
  TempDir dir;
  TrainOptions o = one_step_run(dir);
  // The device homes only the kept inputs, the workspace and the step buffers.
  o.offload_params = o.offload_grads = o.offload_optimizer = "nvme";
  o.checkpoint_activations = "full";
  expect_home_shortfall_names_the_minimum(o, offload::Tier::device);
}

TEST(Placement, HostBudgetBelowItsHomeCopiesNamesTheMinimumWhichRuns) {
  TempDir dir;
  TrainOptions o = one_step_run(dir);
  o.offload_optimizer = "cpu";  // the host homes the master weights and the AdamW state
  expect_home_shortfall_names_the_minimum(o, offload::Tier::host);
}

}  // namespace

namespace {

// On a GPU, initialising, loading and saving stage a unit through pinned host memory next to
// the host's home copies: the host budget the plan picks, and the minimum it names, hold both
// (the first GPU run failed with weights and grads in host memory: its budget was the homes).
TEST(Placement, GpuHostBudgetHoldsTheHomesAndAStagedUnit) {
  TempDir dir;
  write_hf_config(tiny_llama(), dir.path() / "config.json");
  TrainOptions o;
  o.model = dir.path().string();
  o.backend = "cuda";  // planned only: no device needed
  o.batch = 2, o.seq = 16;
  for (const char* what : {"params+grads", "optimizer"}) {
    SCOPED_TRACE(what);
    o.offload_params = o.offload_grads = o.offload_optimizer = "none";
    if (what[0] == 'p') o.offload_params = o.offload_grads = "cpu";
    else o.offload_optimizer = "cpu";
    const RunPlan p = plan_run(o, /*minimums=*/true);
    uint64_t homes = 0;
    for (uint64_t b : p.memory.homed[1]) homes += b;
    ASSERT_GT(homes, 0u);
    EXPECT_GT(p.memory.budget[1], homes);
    EXPECT_GT(p.memory.minimum[1], homes);
    EXPECT_LE(p.memory.minimum[1], p.memory.budget[1]);
    o.host_mem = std::to_string(homes);  // the homes alone are refused before anything starts
    EXPECT_THROW(plan_run(o), offload::BudgetError);
    o.host_mem.clear();
  }
}

}  // namespace
