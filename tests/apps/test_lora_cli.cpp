// `strata train --lora-rank` end to end through the built binary: every placement of the frozen
// base and of the adapters (and activation checkpointing) is bitwise the all-resident LoRA run
// (fp32 and bf16, accumulation 1 and 2); the output is a PEFT adapter (names, shapes, config)
// and the base's files are untouched; a resume is bitwise the uninterrupted run and one against
// another base is refused naming the checksum; malformed --lora-* flags name the flag.
// (scripts/lora_crosscheck.py compares the same runs with an independent PyTorch replay.)
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/runtime.h"
#include "src/checkpoint/hf.h"
#include "src/model/quant.h"
#include "tests/apps/cli_test_util.h"

namespace fs = std::filesystem;

namespace {

using strata::test::slurp;
using Result = strata::test::CliResult;

using strata::test::exact_metrics;

// The tensor names and shapes of a safetensors file (its JSON header).
nlohmann::json safetensors_header(const fs::path& p) {
  const std::string bytes = slurp(p);
  if (bytes.size() < 8) return {};
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  return nlohmann::json::parse(bytes.substr(8, n));
}

class LoraCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = strata::test::make_scratch_dir("strata_lora");
    ASSERT_FALSE(dir_.empty());
    strata::test::write_tiny_llama(dir_ / "cfg", 64, 3, 128);
    fs::create_directories(dir_ / "swap");
    // The base: a saved model (random init, lr 0), so LoRA runs load it as a user's would.
    const Result r = run("train --model " + (dir_ / "cfg").string() + " --threads 1 --seq 16 --steps 1 --lr 0 --out " +
                         base().string());
    ASSERT_EQ(r.status, 0) << r.err;
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path base() const { return dir_ / "base"; }
  std::string lora(int steps, const std::string& lr = "1e-2", const std::string& targets = "all-linear") const {
    return "train --model " + base().string() + " --threads 1 --seq 16 --batch 2 --lr " + lr +
           " --lr-schedule constant --warmup 0 --steps " + std::to_string(steps) +
           " --lora-rank 4 --lora-alpha 8 --lora-targets " + targets + " ";
  }
  Result run(const std::string& args, const std::string& env = "") { return strata::test::run_strata(dir_, args, env); }
  fs::path dir_;
};

TEST_F(LoraCli, EveryPlacementIsBitwiseTheResidentRun) {
  const std::string nvme = " --nvme-path " + (dir_ / "swap").string();
  const std::vector<std::string> placements = {
      "--offload-params cpu --offload-optimizer cpu --offload-grads cpu",
      "--offload-params nvme --offload-optimizer nvme --offload-grads nvme --host-mem 1M" + nvme,
      "--checkpoint-activations full --offload-activations cpu --offload-params cpu",
      "--checkpoint-activations every:2 --offload-optimizer nvme" + nvme,
  };
  for (const char* dtype : {"fp32", "bf16"})
    for (const char* accum : {"1", "2"}) {
      const std::string common = lora(4) + "--dtype " + dtype + " --grad-accum " + accum + " ";
      const fs::path ref = dir_ / "ref";
      Result r = run(common + "--metrics " + (ref / "m.jsonl").string() + " --out " + (ref / "a").string());
      ASSERT_EQ(r.status, 0) << r.err;
      const auto want = exact_metrics(ref / "m.jsonl");
      ASSERT_EQ(want.size(), 4u);
      for (const std::string& pl : placements) {
        const fs::path got = dir_ / "got";
        r = run(common + pl + " --metrics " + (got / "m.jsonl").string() + " --out " + (got / "a").string());
        ASSERT_EQ(r.status, 0) << pl << ": " << r.err;
        EXPECT_EQ(exact_metrics(got / "m.jsonl"), want) << dtype << " accum " << accum << ": " << pl;
        EXPECT_TRUE(slurp(got / "a" / "adapter_model.safetensors") == slurp(ref / "a" / "adapter_model.safetensors"))
            << dtype << " accum " << accum << ": " << pl << ": the saved adapters differ";
        fs::remove_all(got);
      }
      fs::remove_all(ref);
    }
}

TEST_F(LoraCli, WritesAPeftAdapterAndLeavesTheBaseUntouched) {
  const std::string before = slurp(base() / "model.safetensors");
  const fs::path a0 = dir_ / "a0", a = dir_ / "a";
  Result r = run(lora(1, "0") + "--out " + a0.string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("LoRA"), std::string::npos) << r.out;  // the header says what trains
  r = run(lora(3, "1e-2", "q_proj,v_proj") + "--out " + a.string() + " --lora-rslora");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(slurp(base() / "model.safetensors") == before) << "the base's weights changed";

  const auto cfg = nlohmann::json::parse(slurp(a / "adapter_config.json"));
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["r"], 4);
  EXPECT_EQ(cfg["lora_alpha"], 8.0);
  EXPECT_EQ(cfg["use_rslora"], true);
  EXPECT_EQ(cfg["target_modules"], nlohmann::json({"self_attn.q_proj", "self_attn.v_proj"}));
  EXPECT_FALSE(fs::exists(a / "model.safetensors"));
  const Result inspected = run("inspect " + a.string());
  EXPECT_EQ(inspected.status, 0) << inspected.err;
  EXPECT_NE(inspected.out.find("PEFT LoRA adapter"), std::string::npos) << inspected.out;
  EXPECT_NE(inspected.out.find("rank 4, alpha 8"), std::string::npos) << inspected.out;

  // PEFT's names and shapes: A [r, in], B [out, r]; 3 layers × (q, v) × (A, B).
  const auto h = safetensors_header(a / "adapter_model.safetensors");
  EXPECT_EQ(h.size(), 3u * 2 * 2 + (h.contains("__metadata__") ? 1 : 0)) << h.dump();
  const std::string q = "base_model.model.model.layers.2.self_attn.q_proj.";
  const std::string v = "base_model.model.model.layers.0.self_attn.v_proj.";
  ASSERT_TRUE(h.contains(q + "lora_A.weight")) << h.dump();
  EXPECT_EQ(h[q + "lora_A.weight"]["shape"], nlohmann::json({4, 64}));
  EXPECT_EQ(h[q + "lora_B.weight"]["shape"], nlohmann::json({64, 4}));
  EXPECT_EQ(h[v + "lora_B.weight"]["shape"], nlohmann::json({32, 4}));  // 2 kv heads × 16

  // The starting adapter (lr 0): B is zero, A is not.
  const auto h0 = safetensors_header(a0 / "adapter_model.safetensors");
  const std::string bytes = slurp(a0 / "adapter_model.safetensors");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  const auto all_zero = [&](const std::string& name) {
    const auto off = h0[name]["data_offsets"];
    for (uint64_t i = 8 + n + off[0].get<uint64_t>(); i < 8 + n + off[1].get<uint64_t>(); ++i)
      if (bytes[i] != 0) return false;
    return true;
  };
  EXPECT_TRUE(all_zero("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"));
  EXPECT_FALSE(all_zero("base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"));
}

TEST_F(LoraCli, ResumeIsBitwiseAndRefusesAnotherBase) {
  const fs::path ck = dir_ / "ck";
  Result r = run(lora(4) + "--metrics " + (dir_ / "full.jsonl").string() + " --out " + (dir_ / "full").string());
  ASSERT_EQ(r.status, 0) << r.err;
  r = run(lora(2) + "--checkpoint-dir " + ck.string());
  ASSERT_EQ(r.status, 0) << r.err;
  // Only the adapters and their AdamW state are in the checkpoint.
  const auto h = safetensors_header(ck / "step-00000002" / "model.safetensors");
  for (const auto& [name, _] : h.items())
    if (name != "__metadata__") {
      EXPECT_NE(name.find(".lora_"), std::string::npos) << name;
    }
  r = run(lora(4) + "--checkpoint-dir " + ck.string() + " --resume auto --metrics " + (dir_ / "res.jsonl").string() +
          " --out " + (dir_ / "res").string());
  ASSERT_EQ(r.status, 0) << r.err;
  auto full = exact_metrics(dir_ / "full.jsonl");
  full.erase(full.begin(), full.begin() + 2);
  EXPECT_EQ(exact_metrics(dir_ / "res.jsonl"), full);
  EXPECT_TRUE(slurp(dir_ / "res" / "adapter_model.safetensors") == slurp(dir_ / "full" / "adapter_model.safetensors"));

  // Another base (other weights, same shapes): refused, naming the checksum.
  r = run("train --model " + (dir_ / "cfg").string() + " --threads 1 --seq 16 --steps 1 --lr 0 --seed 9 --out " +
          (dir_ / "other").string());
  ASSERT_EQ(r.status, 0) << r.err;
  std::string args = lora(6);
  args.replace(args.find(base().string()), base().string().size(), (dir_ / "other").string());
  r = run(args + "--checkpoint-dir " + ck.string() + " --resume auto");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("crc32c"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(base().string()), std::string::npos) << r.err;  // the base it was trained on
}

// Every tensor of a safetensors file, by name, as fp32.
std::map<std::string, std::vector<float>> tensors_of(const fs::path& file) {
  return strata::test::tensors_of(*strata::HfCheckpoint::open_file(file));
}

// --adapter starts from a PEFT adapter (at lr 0 it is saved back byte for byte; its config sets
// the rank); --merge-adapter writes W + s·B·A in float64 rounded once, every other tensor the
// base's, and the merged model's loss is the adapted one's; generate --adapter gives the merged
// model's tokens.
TEST_F(LoraCli, AdapterInAndMergedModelOut) {
  const fs::path a = dir_ / "a", back = dir_ / "back", merged = dir_ / "merged";
  Result r = run(lora(3, "1e-2", "q_proj,down_proj") + "--out " + a.string());
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string start = "train --model " + base().string() + " --threads 1 --seq 16 --batch 2 --steps 1 --lr 0 ";
  r = run(start + "--adapter " + a.string() + " --metrics " + (dir_ / "ad.jsonl").string() + " --out " + back.string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(slurp(back / "adapter_model.safetensors") == slurp(a / "adapter_model.safetensors"));
  r = run(start + "--adapter " + a.string() + " --merge-adapter --out " + merged.string());
  ASSERT_EQ(r.status, 0) << r.err;
  // The adapter is read: --metrics over one of its files is refused, and the file kept.
  const std::string cfg_before = slurp(a / "adapter_config.json");
  r = run(start + "--adapter " + a.string() + " --metrics " + (a / "adapter_config.json").string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("which this run reads"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(a / "adapter_config.json"), cfg_before);
  r = run(start + "--adapter " + a.string() + " --lora-rank 8");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--lora-rank"), std::string::npos) << r.err;

  const auto w = tensors_of(base() / "model.safetensors"), m = tensors_of(merged / "model.safetensors");
  const auto ad = tensors_of(a / "adapter_model.safetensors");
  ASSERT_EQ(w.size(), m.size());
  int adapted = 0;
  for (const auto& [name, base_w] : w) {
    ASSERT_TRUE(m.count(name)) << name;
    const std::string mod = "base_model.model." + name.substr(0, name.size() - 7);
    if (!ad.count(mod + ".lora_A.weight")) {
      EXPECT_TRUE(m.at(name) == base_w) << name << ": not adapted, so the base's";
      continue;
    }
    ++adapted;
    const auto& A = ad.at(mod + ".lora_A.weight");
    const auto& B = ad.at(mod + ".lora_B.weight");
    const size_t rank = 4, in = A.size() / rank, out = B.size() / rank;
    for (size_t o = 0; o < out; ++o)
      for (size_t i = 0; i < in; ++i) {
        double d = 0;
        for (size_t k = 0; k < rank; ++k) d += static_cast<double>(B[o * rank + k]) * A[k * in + i];
        ASSERT_EQ(m.at(name)[o * in + i], static_cast<float>(base_w[o * in + i] + 2.0 * d)) << name << " " << o << "," << i;
      }
  }
  EXPECT_EQ(adapted, 3 * 2);
  r = run("train --model " + merged.string() + " --threads 1 --seq 16 --batch 2 --steps 1 --lr 0 --metrics " +
          (dir_ / "m.jsonl").string());
  ASSERT_EQ(r.status, 0) << r.err;
  const auto loss = [](const fs::path& p) { return nlohmann::json::parse(slurp(p).substr(0, slurp(p).find('\n')))["loss"].get<double>(); };
  EXPECT_NEAR(loss(dir_ / "m.jsonl"), loss(dir_ / "ad.jsonl"), 1e-6 * loss(dir_ / "ad.jsonl"));

  // `strata generate --adapter` merges as it loads: the merged model's tokens.
  const std::string gen = " --prompt-ids 5,6,7,8 --max-new-tokens 16 --temperature 0 --threads 1 --json";
  const Result with_adapter = run("generate --model " + base().string() + " --adapter " + a.string() + gen);
  const Result from_merged = run("generate --model " + merged.string() + gen);
  ASSERT_EQ(with_adapter.status, 0) << with_adapter.err;
  ASSERT_EQ(from_merged.status, 0) << from_merged.err;
  EXPECT_EQ(nlohmann::json::parse(with_adapter.out)["ids"], nlohmann::json::parse(from_merged.out)["ids"]);
  EXPECT_NE(nlohmann::json::parse(with_adapter.out)["ids"],
            nlohmann::json::parse(run("generate --model " + base().string() + gen).out)["ids"]);
}

// --base-dtype int8/nf4: the run equals, bit for bit, the same run on a base that holds the
// decoded weights in fp32 (the layers' matrices quantized and dequantized here with the same
// library; the embedding, norms and head as they were); the stored base's placements (NVMe,
// host) are bitwise the resident one; its bytes shrink as the kind says.
TEST_F(LoraCli, QuantizedBaseEqualsItsDecodedWeights) {
  const strata::ModelConfig cfg = strata::read_hf_config(base() / "config.json");
  for (const char* kind : {"int8", "nf4"}) {
    std::vector<strata::TensorToSave> tensors;
    const auto w = tensors_of(base() / "model.safetensors");
    std::map<std::string, std::vector<float>> decoded;
    auto ck = strata::HfCheckpoint::open(base());
    for (const auto& t : ck->tensors()) {
      std::vector<float> v = w.at(t.name);
      if (t.shape.size() == 2 && t.name.find(".layers.") != std::string::npos) {
        const strata::QuantizedTensor q = strata::QuantizedTensor::make(
            strata::parse_quant_kind(kind), v.data(), strata::kernels::DType::f32, t.shape[0], t.shape[1]);
        q.dequantize_rows(0, t.shape[0], v.data(), strata::kernels::DType::f32);
      }
      decoded[t.name] = std::move(v);
      const std::vector<float>* src = &decoded[t.name];
      tensors.push_back({t.name, t.shape, strata::kernels::DType::f32,
                         [src](void* dst) { std::memcpy(dst, src->data(), src->size() * 4); }});
    }
    const fs::path dq = dir_ / (std::string("dq_") + kind);
    strata::save_hf_model(dq, cfg, tensors);

    // The CUDA backend's decode kernel too, where a GPU is present.
    for (const std::string backend : {"cpu", "cuda"}) {
      if (backend == "cuda" && !strata::kernels::cuda_available()) continue;
      const std::string common = " --backend " + backend +
                                 " --threads 1 --seq 16 --batch 2 --lr 1e-2 --lr-schedule constant --warmup 0 "
                                 "--steps 3 --lora-rank 4 --lora-targets all-linear --metrics ";
      Result r = run("train --model " + dq.string() + common + (dir_ / "dq.jsonl").string());
      ASSERT_EQ(r.status, 0) << r.err;
      r = run("train --model " + base().string() + common + (dir_ / "q.jsonl").string() + " --base-dtype " + kind);
      ASSERT_EQ(r.status, 0) << r.err;
      EXPECT_EQ(exact_metrics(dir_ / "q.jsonl"), exact_metrics(dir_ / "dq.jsonl")) << kind << " " << backend;
      r = run("train --model " + base().string() + common + (dir_ / "qn.jsonl").string() + " --base-dtype " + kind +
              " --offload-params nvme --host-mem 1M --nvme-path " + (dir_ / "swap").string());
      ASSERT_EQ(r.status, 0) << r.err;
      EXPECT_EQ(exact_metrics(dir_ / "qn.jsonl"), exact_metrics(dir_ / "dq.jsonl")) << kind << " on NVMe, " << backend;
    }
  }
}

// --lora-dropout: masks from the step and micro-batch, so a run with dropout differs from one
// without, and is bitwise itself on NVMe with recomputed (checkpointed) layers and across a
// resume.
TEST_F(LoraCli, DropoutIsDeterministicEverywhere) {
  const std::string cmd = lora(4) + "--grad-accum 2 --lora-dropout 0.25 ";
  Result r = run(lora(4) + "--grad-accum 2 --metrics " + (dir_ / "none.jsonl").string());
  ASSERT_EQ(r.status, 0) << r.err;
  r = run(cmd + "--metrics " + (dir_ / "ref.jsonl").string() + " --out " + (dir_ / "ref").string());
  ASSERT_EQ(r.status, 0) << r.err;
  const auto ref = exact_metrics(dir_ / "ref.jsonl");
  ASSERT_EQ(ref.size(), 4u);
  // B starts at zero: step 1's loss is the base's either way (its gradients are not).
  const auto loss_of = [](const std::string& row) { return row.substr(0, row.find(' ', row.find(' ') + 1)); };
  EXPECT_EQ(loss_of(ref[0]), loss_of(exact_metrics(dir_ / "none.jsonl")[0]));
  EXPECT_NE(ref, exact_metrics(dir_ / "none.jsonl"));
  r = run(cmd + "--checkpoint-activations full --offload-params nvme --offload-optimizer nvme --host-mem 1M "
                "--nvme-path " + (dir_ / "swap").string() + " --metrics " + (dir_ / "nv.jsonl").string() + " --out " +
          (dir_ / "nv").string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(exact_metrics(dir_ / "nv.jsonl"), ref);
  EXPECT_TRUE(slurp(dir_ / "nv" / "adapter_model.safetensors") == slurp(dir_ / "ref" / "adapter_model.safetensors"));
  const std::string half = lora(2) + "--grad-accum 2 --lora-dropout 0.25 ";
  r = run(half + "--checkpoint-dir " + (dir_ / "ck").string());
  ASSERT_EQ(r.status, 0) << r.err;
  r = run(cmd + "--checkpoint-dir " + (dir_ / "ck").string() + " --resume auto --metrics " + (dir_ / "res.jsonl").string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(exact_metrics(dir_ / "res.jsonl"), std::vector<std::string>(ref.begin() + 2, ref.end()));
  const auto cfg = nlohmann::json::parse(slurp(dir_ / "ref" / "adapter_config.json"));
  EXPECT_EQ(cfg["lora_dropout"], 0.25);
  // On a GPU the masks are the CUDA kernel's: the resident run and the recomputed one on NVMe
  // agree bit for bit there too.
  if (!strata::kernels::cuda_available()) return;
  r = run(cmd + "--backend cuda --metrics " + (dir_ / "g.jsonl").string());
  ASSERT_EQ(r.status, 0) << r.err;
  r = run(cmd + "--backend cuda --checkpoint-activations full --offload-params nvme --nvme-path " +
          (dir_ / "gswap").string() + " --metrics " + (dir_ / "gnv.jsonl").string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(exact_metrics(dir_ / "gnv.jsonl"), exact_metrics(dir_ / "g.jsonl"));
}

TEST_F(LoraCli, BadFlagsNameTheFlag) {
  const std::string cmd = "train --model " + base().string() + " --threads 1 --seq 16 --steps 1 ";
  const std::pair<std::string, std::string> cases[] = {
      {"--lora-rank -1", "--lora-rank"},
      {"--lora-rank 4 --lora-alpha 0", "--lora-alpha"},
      {"--lora-rank 4 --lora-dropout 1.5", "--lora-dropout"},
      {"--lora-rank 4 --lora-targets q_proj,,v_proj", "--lora-targets"},
      {"--lora-rank 4 --lora-targets c_attn", "c_attn"},  // a gpt2 module on a llama: the list of modules
      {"--lora-targets q_proj", "--lora-rank"},
      {"--lora-rank 4 --base-dtype int9", "--base-dtype int9"},
      {"--lora-rank 4 --base-dtype nf4 --zero-stage 3", "--zero-stage 3"},  // a stored base is not sharded
  };
  for (const auto& [flags, want] : cases) {
    const Result r = run(cmd + flags);
    EXPECT_NE(r.status, 0) << flags;
    EXPECT_NE(r.err.find(want), std::string::npos) << flags << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  Result r = run(cmd + "--lora-rank 4 --lora-targets c_attn");
  EXPECT_NE(r.err.find("self_attn.q_proj"), std::string::npos) << r.err;
  // An adapter never replaces its own base, --overwrite-model or not; the base stays whole.
  const std::string before = slurp(base() / "model.safetensors");
  r = run(cmd + "--lora-rank 4 --out " + base().string() + " --overwrite-model");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("the adapter would replace the base"), std::string::npos) << r.err;
  EXPECT_TRUE(slurp(base() / "model.safetensors") == before);
}

}  // namespace
