#!/usr/bin/env python3
"""Cross-checks `strata train` against an independent PyTorch implementation, through the files
strata writes. Optional (needs Debian's python3-torch under /usr/bin/python3; the project's own
tests need no Python):

    /usr/bin/python3 scripts/hf_crosscheck.py [--strata build/bin/strata]

For a small gpt2, a qwen2-style llama (GQA, q/k/v biases, untied head) and a llama with tied
embeddings and llama3 rope scaling, it

  1. writes config.json and an llm.c token shard, runs `strata train` for 3 steps (constant lr,
     weight decay, grad clipping, grad accumulation 2) with --out and --metrics, and a second,
     zero-step-equivalent run (lr 0, --steps 1) that saves the initial weights;
  2. reads the saved safetensors itself (header, dtypes, offsets) and checks that the tensor
     names and shapes are exactly those Hugging Face `transformers` uses for that config
     (GPT2LMHeadModel / LlamaForCausalLM / Qwen2ForCausalLM state dicts, Conv1D weights [in, out],
     a tied head not stored);
  3. rebuilds the model in plain torch (written here from the HF modelling code's definitions),
     loads the initial weights, and replays the run: llm.c batching, mean cross-entropy,
     global-norm clipping, torch.optim.AdamW with decay on 2-D tensors only; then compares every
     step's loss and grad norm with strata's metrics and the final weights with strata's output.

`transformers` itself is not packaged for Debian 12, so it cannot be imported here; step 2 is
the part of "transformers loads it" that can be checked without it. Exits non-zero on mismatch.
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

DT = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


# ---- safetensors, read by hand (the safetensors package is not installed) ---------------------
def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    # transformers refuses safetensors whose metadata names another framework
    if header.get("__metadata__", {}).get("format", "pt") != "pt":
        raise ValueError(f"{path}: __metadata__.format is not 'pt'")
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        t = torch.frombuffer(bytearray(data[base + a:base + b]), dtype=DT[meta["dtype"]])
        out[name] = t.reshape(meta["shape"]).float()
    return out


def read_model_dir(d):
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for f in files:
        tensors.update(read_safetensors(os.path.join(d, f)))
    return tensors


# ---- the HF state-dict key sets and shapes -----------------------------------------------------
def hf_expected(cfg):
    if cfg["model_type"] == "gpt2":
        c, v, p = cfg["n_embd"], cfg["vocab_size"], cfg["n_positions"]
        inner = cfg.get("n_inner") or 4 * c
        e = {"transformer.wte.weight": [v, c], "transformer.wpe.weight": [p, c],
             "transformer.ln_f.weight": [c], "transformer.ln_f.bias": [c]}
        for i in range(cfg["n_layer"]):
            h = f"transformer.h.{i}."
            e.update({h + "ln_1.weight": [c], h + "ln_1.bias": [c], h + "ln_2.weight": [c], h + "ln_2.bias": [c],
                      h + "attn.c_attn.weight": [c, 3 * c], h + "attn.c_attn.bias": [3 * c],
                      h + "attn.c_proj.weight": [c, c], h + "attn.c_proj.bias": [c],
                      h + "mlp.c_fc.weight": [c, inner], h + "mlp.c_fc.bias": [inner],
                      h + "mlp.c_proj.weight": [inner, c], h + "mlp.c_proj.bias": [c]})
        return e  # lm_head.weight is tied to wte and not saved by transformers either
    c, v = cfg["hidden_size"], cfg["vocab_size"]
    hq, hkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or c // hq
    inter = cfg["intermediate_size"]
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    o_bias = cfg["model_type"] != "qwen2" and cfg.get("attention_bias", False)
    mlp_bias = cfg.get("mlp_bias", False)
    e = {"model.embed_tokens.weight": [v, c], "model.norm.weight": [c]}
    if not cfg.get("tie_word_embeddings", False):
        e["lm_head.weight"] = [v, c]
    for i in range(cfg["num_hidden_layers"]):
        h = f"model.layers.{i}."
        e.update({h + "input_layernorm.weight": [c], h + "post_attention_layernorm.weight": [c],
                  h + "self_attn.q_proj.weight": [hq * d, c], h + "self_attn.k_proj.weight": [hkv * d, c],
                  h + "self_attn.v_proj.weight": [hkv * d, c], h + "self_attn.o_proj.weight": [c, hq * d],
                  h + "mlp.gate_proj.weight": [inter, c], h + "mlp.up_proj.weight": [inter, c],
                  h + "mlp.down_proj.weight": [c, inter]})
        if qkv_bias:
            e.update({h + "self_attn.q_proj.bias": [hq * d], h + "self_attn.k_proj.bias": [hkv * d],
                      h + "self_attn.v_proj.bias": [hkv * d]})
        if o_bias:
            e[h + "self_attn.o_proj.bias"] = [c]
        if mlp_bias:
            e.update({h + "mlp.gate_proj.bias": [inter], h + "mlp.up_proj.bias": [inter],
                      h + "mlp.down_proj.bias": [c]})
    return e


# ---- the models, as HF's modelling code defines them -------------------------------------------
def causal_attention(q, k, v):  # (B, H, T, D), k/v already repeated to H heads
    t = q.shape[2]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    return F.softmax(att, dim=-1) @ v


def gpt2_loss(cfg, w, ids, tgt):
    b, t = ids.shape
    c, nh = cfg["n_embd"], cfg["n_head"]
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    x = w["transformer.wte.weight"][ids] + w["transformer.wpe.weight"][torch.arange(t)]
    for i in range(cfg["n_layer"]):
        h = f"transformer.h.{i}."
        a = F.layer_norm(x, (c,), w[h + "ln_1.weight"], w[h + "ln_1.bias"], eps)
        qkv = a @ w[h + "attn.c_attn.weight"] + w[h + "attn.c_attn.bias"]  # Conv1D: x·W + b, W [in, out]
        q, k, v = (z.view(b, t, nh, c // nh).transpose(1, 2) for z in qkv.split(c, dim=2))
        y = causal_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        x = x + y @ w[h + "attn.c_proj.weight"] + w[h + "attn.c_proj.bias"]
        a = F.layer_norm(x, (c,), w[h + "ln_2.weight"], w[h + "ln_2.bias"], eps)
        act = cfg.get("activation_function", "gelu_new")
        f = F.gelu(a @ w[h + "mlp.c_fc.weight"] + w[h + "mlp.c_fc.bias"],
                   approximate="none" if act == "gelu" else "tanh")
        x = x + f @ w[h + "mlp.c_proj.weight"] + w[h + "mlp.c_proj.bias"]
    x = F.layer_norm(x, (c,), w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], eps)
    logits = x @ w["transformer.wte.weight"].t()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def rope_inv_freq(cfg, d):
    inv = 1.0 / (cfg.get("rope_theta", 10000.0) ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.get("rope_scaling")
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":  # transformers' _compute_llama3_parameters
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        inv_l = torch.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        is_medium = ~(wl < hi_wl) * ~(wl > lo_wl)
        inv = torch.where(is_medium, smoothed, inv_l)
    return inv


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def llama_loss(cfg, w, ids, tgt):
    b, t = ids.shape
    c = cfg["hidden_size"]
    hq = cfg["num_attention_heads"]
    hkv = cfg.get("num_key_value_heads", hq)
    d = cfg.get("head_dim") or c // hq
    eps = cfg.get("rms_norm_eps", 1e-6)
    freqs = torch.outer(torch.arange(t).float(), rope_inv_freq(cfg, d))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def lin(x, name):
        y = x @ w[name + ".weight"].t()
        return y + w[name + ".bias"] if name + ".bias" in w else y

    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        h = f"model.layers.{i}."
        a = rms_norm(x, w[h + "input_layernorm.weight"], eps)
        q = lin(a, h + "self_attn.q_proj").view(b, t, hq, d).transpose(1, 2)
        k = lin(a, h + "self_attn.k_proj").view(b, t, hkv, d).transpose(1, 2)
        v = lin(a, h + "self_attn.v_proj").view(b, t, hkv, d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
        y = causal_attention(q, k, v).transpose(1, 2).reshape(b, t, hq * d)
        x = x + lin(y, h + "self_attn.o_proj")
        a = rms_norm(x, w[h + "post_attention_layernorm.weight"], eps)
        x = x + lin(F.silu(lin(a, h + "mlp.gate_proj")) * lin(a, h + "mlp.up_proj"), h + "mlp.down_proj")
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    logits = x @ head.t()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


# ---- the run -----------------------------------------------------------------------------------
def write_shard(path, tokens):
    hdr = [0] * 256
    hdr[0], hdr[1], hdr[2] = 20240801, 7, len(tokens)
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *hdr))
        f.write(struct.pack(f"<{len(tokens)}I", *tokens))


def run_strata(strata, model_dir, shard, out, metrics, flags):
    cmd = [strata, "train", "--model", model_dir, "--data", shard, "--out", out, "--metrics", metrics,
           "--log-every", "100"] + flags
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"strata failed ({' '.join(cmd)}):\n{r.stdout}\n{r.stderr}")
    return [json.loads(line) for line in open(metrics)]


def check(name, cfg, strata, tmp):
    failures = []
    d = os.path.join(tmp, name)
    os.makedirs(os.path.join(d, "cfg"))
    json.dump(cfg, open(os.path.join(d, "cfg", "config.json"), "w"))
    B, T, accum, steps = 2, 8, 2, 3
    lr, wd, b1, b2, eps, clip = 3e-3, 0.1, 0.9, 0.95, 1e-8, 0.5
    g = torch.Generator().manual_seed(7)
    n_tok = steps * accum * B * T + 1
    tokens = torch.randint(0, cfg["vocab_size"], (n_tok,), generator=g).tolist()
    shard = os.path.join(d, "data.bin")
    write_shard(shard, tokens)
    common = ["--batch", str(B), "--seq", str(T), "--grad-accum", str(accum), "--seed", "5",
              "--lr-schedule", "constant", "--warmup", "0", "--weight-decay", str(wd), "--beta1", str(b1),
              "--beta2", str(b2), "--eps", str(eps), "--grad-clip", str(clip), "--dtype", "fp32"]
    run_strata(strata, os.path.join(d, "cfg"), shard, os.path.join(d, "init"), os.path.join(d, "m0.jsonl"),
               common + ["--steps", "1", "--lr", "0"])
    metrics = run_strata(strata, os.path.join(d, "cfg"), shard, os.path.join(d, "out"),
                         os.path.join(d, "m.jsonl"), common + ["--steps", str(steps), "--lr", str(lr)])

    saved_cfg = json.load(open(os.path.join(d, "out", "config.json")))
    arch = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "mistral": "MistralForCausalLM"}[cfg["model_type"]]
    if saved_cfg.get("model_type") != cfg["model_type"] or saved_cfg.get("architectures") != [arch]:
        failures.append(f"config.json: model_type {saved_cfg.get('model_type')}, architectures "
                        f"{saved_cfg.get('architectures')} (want {cfg['model_type']}, [{arch}])")
    init = read_model_dir(os.path.join(d, "init"))
    final = read_model_dir(os.path.join(d, "out"))
    want = hf_expected(saved_cfg)
    for label, tensors in (("init", init), ("out", final)):
        if set(tensors) != set(want):
            failures.append(f"{label}: names differ from HF's: missing {sorted(set(want) - set(tensors))[:5]}, "
                            f"extra {sorted(set(tensors) - set(want))[:5]}")
        for k, shape in want.items():
            if k in tensors and list(tensors[k].shape) != shape:
                failures.append(f"{label}: {k} has shape {list(tensors[k].shape)}, HF's is {shape}")
    if failures:
        return failures

    loss_fn = gpt2_loss if cfg["model_type"] == "gpt2" else llama_loss
    tok = torch.tensor(tokens)

    def replay(dtype):  # torch's run from the saved initial weights: (per-step loss, norm), weights
        params = {k: v.clone().to(dtype).requires_grad_(True) for k, v in init.items()}
        groups = [{"params": [p for p in params.values() if p.dim() == 2], "weight_decay": wd},
                  {"params": [p for p in params.values() if p.dim() != 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=lr, betas=(b1, b2), eps=eps)
        pos, per_step = 0, []
        for _ in range(steps):
            opt.zero_grad()
            total = 0.0
            for _ in range(accum):  # llm.c batching: B·T+1 tokens, then advance by B·T
                ids = tok[pos:pos + B * T].view(B, T)
                tgt = tok[pos + 1:pos + B * T + 1].view(B, T)
                pos += B * T
                loss = loss_fn(saved_cfg, params, ids, tgt) / accum
                loss.backward()
                total += loss.item()
            per_step.append((total, torch.nn.utils.clip_grad_norm_(list(params.values()), clip).item()))
            opt.step()
        return per_step, {k: p.detach().double() for k, p in params.items()}

    ref_steps, ref = replay(torch.float64)
    _, f32 = replay(torch.float32)
    for s, (total, norm) in enumerate(ref_steps):
        m = metrics[s]
        if not abs(m["loss"] - total) <= 2e-5 * max(1.0, abs(total)):  # "not <=": NaN fails
            failures.append(f"step {s + 1}: loss {m['loss']} vs torch {total}")
        if not abs(m["grad_norm"] - norm) <= 1e-4 * max(1e-3, norm):
            failures.append(f"step {s + 1}: grad_norm {m['grad_norm']} vs torch {norm}")

    # Final weights against the float64 replay, next to PyTorch's own float32 run of the same
    # thing. Adam divides m by sqrt(v): where a gradient changes sign between steps (m near 0) or
    # is ~eps, fp32 rounding moves an update by a few % of lr in ANY fp32 implementation, so the
    # max is only reported. The median and the 99.9th percentile of |strata - float64| must be
    # within 8x of torch fp32's, or below 1e-8 / 1e-6 (a few fp32 ulps of these ~0.02 weights).
    def stats(w):
        d = torch.cat([(w[k] - ref[k]).abs().flatten() for k in ref])
        return {q: d.quantile(q).item() for q in (0.5, 0.999)} | {1.0: d.max().item()}

    if not all(torch.isfinite(v).all() for v in final.values()):
        failures.append("final weights: strata saved non-finite values")
    ours, theirs = stats({k: v.double() for k, v in final.items()}), stats(f32)
    for q, floor in ((0.5, 1e-8), (0.999, 1e-6)):
        if not ours[q] <= max(8 * theirs[q], floor):  # NaN anywhere makes a quantile NaN: fails
            failures.append(f"final weights: quantile {q} of |strata - float64| = {ours[q]:.3g}, "
                            f"torch fp32 has {theirs[q]:.3g}")
    print(f"{name}: {len(want)} tensors named and shaped as HF's; {steps} steps with loss and grad norm as "
          f"torch's; final weights |strata - float64| median/99.9%/max {ours[0.5]:.1e}/{ours[0.999]:.1e}/"
          f"{ours[1.0]:.1e} (torch fp32: {theirs[0.5]:.1e}/{theirs[0.999]:.1e}/{theirs[1.0]:.1e})")
    return failures


CONFIGS = {
    "gpt2": {"model_type": "gpt2", "n_embd": 48, "n_layer": 2, "n_head": 4, "vocab_size": 97, "n_positions": 32,
             "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new", "tie_word_embeddings": True},
    "qwen2_gqa": {"model_type": "qwen2", "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
                  "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 101,
                  "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "hidden_act": "silu", "tie_word_embeddings": False},
    "llama_tied_llama3_rope": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                               "head_dim": 16, "vocab_size": 89, "max_position_embeddings": 64,
                               "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
                               "tie_word_embeddings": True,
                               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strata", default=os.path.join(os.path.dirname(__file__), "..", "build", "bin", "strata"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in CONFIGS.items():
            failures += [f"{name}: {f}" for f in check(name, cfg, a.strata, tmp)]
    for f in failures:
        print("MISMATCH", f)
    print("hf_crosscheck:", "FAILED" if failures else "all checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
