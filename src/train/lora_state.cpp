// LoRA's files: PEFT's adapter_config.json, and --merge-adapter's merged model, written unit by
// unit (one base unit staged at a time, never the whole model).
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "src/checkpoint/hf.h"
#include "src/train/trainer_impl.h"

namespace strata {
namespace fs = std::filesystem;

// PEFT's adapter_config.json (LoraConfig's fields) for the adapters this run trains.
nlohmann::json Trainer::Impl::peft_config() const {
  const LoraSpec& l = model->lora_spec();
  nlohmann::json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = o.model.empty() ? nullptr : nlohmann::json(fs::absolute(o.model).lexically_normal().string());
  j["r"] = l.rank;
  j["lora_alpha"] = l.alpha;
  j["use_rslora"] = l.rslora;
  j["lora_dropout"] = o.lora_dropout;
  j["target_modules"] = model->lora_modules();
  j["bias"] = "none";
  j["fan_in_fan_out"] = cfg.family == Family::gpt2;  // HF Conv1D base weights are (in, out)
  j["modules_to_save"] = nullptr;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  return j;
}

// Each base tensor as the HF save writes it (fp32); an adapted weight is W + s·B·A, the product
// and the sum in float64 and rounded once. W is the base as loaded (--model's safetensors, or
// the random init from --seed), not its working-dtype copy.
void Trainer::Impl::gather_base(std::vector<std::vector<float>>& table) {
  if (sh.rank != 0) return;  // the tp groups of data-parallel rank 0 gather (as gather_tensors)
  const auto index = [&](const ParamInfo& p) { return static_cast<size_t>(&p - model->params().data()); };
  std::vector<float> part;
  if (base_weights) {  // the whole tensors as rank 0 reads them (a part's load reads them whole)
    if (!rank0()) return;
    const auto base_file = HfCheckpoint::open(o.model);
    for (size_t ui = 0; ui < model->units().size(); ++ui) {
      if (model->units()[ui].trainable) continue;
      part.resize(static_cast<size_t>(model->units()[ui].numel));
      model->load_unit(static_cast<int>(ui), *base_file, part.data(), "", [&](const ParamInfo& p, const float* v) {
        int64_t numel = 1;
        for (int64_t x : p.full_shape) numel *= x;
        table[index(p)].assign(v, v + numel);
      });
    }
    return;
  }
  for (size_t ui = 0; ui < model->units().size(); ++ui) {  // a random base: each rank's part, gathered
    const Unit& unit = model->units()[ui];
    if (unit.trainable) continue;
    part.resize(static_cast<size_t>(unit.numel));
    model->init_unit(static_cast<int>(ui), o.seed, part.data());
    for (int pi : unit.params) {
      std::vector<float> w = whole_tensor(model->params()[static_cast<size_t>(pi)], part.data());  // (tp rank 0's)
      if (rank0()) table[static_cast<size_t>(pi)] = std::move(w);
    }
  }
}

void Trainer::Impl::save_merged(const std::string& out_dir, const std::vector<std::vector<float>>* tensors) {
  ModelConfig c = cfg;
  c.torch_dtype = "float32";
  std::unique_ptr<HfCheckpoint> base_file;
  if (base_weights) base_file = HfCheckpoint::open(o.model);
  const double s = peft_scale(model->lora_spec());
  const bool in_out = cfg.family == Family::gpt2;  // HF Conv1D: W stored (in, out)
  const auto index = [&](const ParamInfo& p) { return static_cast<size_t>(&p - model->params().data()); };
  // The base unit being written, staged whole (fp32); under tensor parallelism the base's whole
  // tensors are in `tensors` (gather_base).
  int staged = -1;
  std::vector<float> unit_buf;
  const auto base = [&](const ParamInfo& p) -> const float* {
    if (tp().on()) return (*tensors)[index(p)].data();
    if (staged != p.unit) {
      unit_buf.resize(static_cast<size_t>(model->units()[static_cast<size_t>(p.unit)].numel));
      if (base_file)
        model->load_unit(p.unit, *base_file, unit_buf.data());
      else
        model->init_unit(p.unit, o.seed, unit_buf.data());
      staged = p.unit;
    }
    return unit_buf.data() + p.unit_offset;
  };
  // An adapter tensor's fp32 master, whole (a copy: its block is released before the next acquire).
  const auto adapter = [&](const ParamInfo& p) {
    std::vector<float> v;
    if (tensors) {
      v = (*tensors)[index(p)];
    } else {
      const auto* src = static_cast<const float*>(mem->acquire(Role::master, p.unit, offload::Mode::read, Side::host));
      v.assign(src + p.unit_offset, src + p.unit_offset + p.numel);
      mem->release(Role::master, p.unit);
    }
    for (float x : v)
      if (!std::isfinite(x)) throw std::runtime_error("'" + p.name + "' is not finite: the run diverged; nothing was saved");
    return v;
  };
  std::vector<TensorToSave> to_save;
  for (const ParamInfo& p : model->params()) {
    if (model->units()[static_cast<size_t>(p.unit)].trainable) continue;  // the adapters go into W
    const std::string mod = p.name.size() > 7 ? p.name.substr(0, p.name.size() - 7) : "";  // minus ".weight"
    const ParamInfo* a = p.name.ends_with(".weight") ? model->find_param(mod + ".lora_A.weight") : nullptr;
    const ParamInfo* b = a ? model->find_param(mod + ".lora_B.weight") : nullptr;
    to_save.push_back({p.name, p.full_shape, DType::f32, [&, pp = &p, a, b](void* dst) {
                         int64_t numel = 1;
                         for (int64_t x : pp->full_shape) numel *= x;
                         auto* out = static_cast<float*>(dst);
                         std::memcpy(out, base(*pp), static_cast<size_t>(numel) * 4);
                         if (!a) return;
                         const std::vector<float> A = adapter(*a), B = adapter(*b);
                         add_lora_delta(out, A.data(), B.data(), a->full_shape[0], a->full_shape[1], b->full_shape[0],
                                        s, in_out);
                       }});
  }
  std::vector<fs::path> tokenizer;
  if (!o.model.empty())
    for (const char* name : kTokenizerFiles)
      if (fs::is_regular_file(fs::path(o.model) / name)) tokenizer.push_back(fs::path(o.model) / name);
  mem->begin_step(TieredMemory::Schedule::aside);
  try {
    save_hf_model(out_dir, c, to_save, 5ull << 30, tokenizer);
  } catch (...) {
    mem->end_step();
    throw;
  }
  mem->end_step();
}

}  // namespace strata
