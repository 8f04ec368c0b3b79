#!/usr/bin/env python3
"""Cross-checks `strata train --lora-rank` against an independent PyTorch replay (optional: needs
Debian's python3-torch; the project's own tests need no Python):

    /usr/bin/python3 scripts/lora_crosscheck.py [--strata build/bin/strata]

For a small gpt2 and a qwen2-style llama it saves a base model (a full run at lr 0), then

  1. trains LoRA adapters on it for 6 steps (grad accumulation 2, clipping, weight decay) with
     --out, and saves the starting adapter (the same run at lr 0);
  2. checks the adapter files are PEFT's (adapter_config.json fields, tensor names
     base_model.model.<module>.lora_A/B.weight, A [r, in], B [out, r], B zero at the start);
  3. replays the run in torch (hf_crosscheck.py's models, each target's weight W + s·B·A, A and
     B trained by torch.optim.AdamW, the base frozen) and compares every step's loss and grad
     norm (2e-4 relative) and the final adapters (2e-3);
  4. checks the base model's files are bitwise what they were.
"""
import argparse
import hashlib
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from hf_crosscheck import (CONFIGS, gpt2_loss, llama_loss, read_model_dir, read_safetensors,  # noqa: E402
                           run_strata, write_shard)

TARGETS = {"gpt2": "c_attn,c_proj,c_fc", "qwen2_gqa": "all-linear"}


def digest(d):
    h = hashlib.sha256()
    for f in sorted(os.listdir(d)):
        h.update(f.encode() + open(os.path.join(d, f), "rb").read())
    return h.hexdigest()


def check(name, cfg, strata, tmp):
    failures = []
    d = os.path.join(tmp, name)
    os.makedirs(os.path.join(d, "cfg"))
    json.dump(cfg, open(os.path.join(d, "cfg", "config.json"), "w"))
    B, T, accum, steps, r, alpha = 2, 8, 2, 6, 4, 8.0
    lr, wd, b1, b2, eps, clip = 5e-3, 0.1, 0.9, 0.95, 1e-8, 0.5
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, cfg["vocab_size"], (steps * accum * B * T + 1,), generator=g).tolist()
    shard = os.path.join(d, "data.bin")
    write_shard(shard, tokens)
    common = ["--batch", str(B), "--seq", str(T), "--grad-accum", str(accum), "--seed", "5",
              "--lr-schedule", "constant", "--warmup", "0", "--weight-decay", str(wd), "--beta1", str(b1),
              "--beta2", str(b2), "--eps", str(eps), "--grad-clip", str(clip), "--dtype", "fp32"]
    base_dir = os.path.join(d, "base")
    run_strata(strata, os.path.join(d, "cfg"), shard, base_dir, os.path.join(d, "b.jsonl"),
               common + ["--steps", "1", "--lr", "0"])
    before = digest(base_dir)
    lora = ["--lora-rank", str(r), "--lora-alpha", str(alpha), "--lora-targets", TARGETS[name]]
    run_strata(strata, base_dir, shard, os.path.join(d, "a0"), os.path.join(d, "m0.jsonl"),
               common + lora + ["--steps", "1", "--lr", "0"])
    metrics = run_strata(strata, base_dir, shard, os.path.join(d, "a"), os.path.join(d, "m.jsonl"),
                         common + lora + ["--steps", str(steps), "--lr", str(lr)])
    if digest(base_dir) != before:
        failures.append("the base model's files changed")

    acfg = json.load(open(os.path.join(d, "a", "adapter_config.json")))
    for k, v in (("peft_type", "LORA"), ("r", r), ("lora_alpha", alpha), ("bias", "none"),
                 ("fan_in_fan_out", cfg["model_type"] == "gpt2")):
        if acfg.get(k) != v:
            failures.append(f"adapter_config.json: {k} = {acfg.get(k)!r}, want {v!r}")
    a0 = read_safetensors(os.path.join(d, "a0", "adapter_model.safetensors"))
    a1 = read_safetensors(os.path.join(d, "a", "adapter_model.safetensors"))
    base = read_model_dir(base_dir)
    scale = alpha / r
    mods = sorted({k[len("base_model.model."):-len(".lora_A.weight")] for k in a0 if k.endswith(".lora_A.weight")})
    for m in mods:
        A, Bm = a0[f"base_model.model.{m}.lora_A.weight"], a0[f"base_model.model.{m}.lora_B.weight"]
        W = base[m + ".weight"]
        out_f, in_f = (W.shape[1], W.shape[0]) if cfg["model_type"] == "gpt2" else tuple(W.shape)
        if list(A.shape) != [r, in_f] or list(Bm.shape) != [out_f, r]:
            failures.append(f"{m}: A {list(A.shape)}, B {list(Bm.shape)}; PEFT's are [{r}, {in_f}], [{out_f}, {r}]")
        if Bm.abs().max() != 0:
            failures.append(f"{m}: B does not start at zero")
        bound = 1 / in_f ** 0.5
        if A.abs().max() > bound or A.std() < 0.3 * bound:
            failures.append(f"{m}: A is not Kaiming-uniform(a=sqrt 5) (bound {bound:.3g}, max {A.abs().max():.3g})")
    if set(a0) != set(a1):
        failures.append("the trained adapter's tensors differ from the starting one's")
    if failures:
        return failures

    saved_cfg = json.load(open(os.path.join(base_dir, "config.json")))
    loss_fn = gpt2_loss if cfg["model_type"] == "gpt2" else llama_loss
    tok = torch.tensor(tokens)

    def replay(dtype):
        ad = {k: v.clone().to(dtype).requires_grad_(True) for k, v in a0.items()}
        frozen = {k: v.to(dtype) for k, v in base.items()}
        opt = torch.optim.AdamW([{"params": list(ad.values()), "weight_decay": wd}], lr=lr, betas=(b1, b2), eps=eps)
        pos, per_step = 0, []
        for _ in range(steps):
            opt.zero_grad()
            total = 0.0
            for _ in range(accum):
                w = dict(frozen)
                for m in mods:
                    delta = scale * ad[f"base_model.model.{m}.lora_B.weight"] @ ad[f"base_model.model.{m}.lora_A.weight"]
                    w[m + ".weight"] = frozen[m + ".weight"] + (delta.t() if cfg["model_type"] == "gpt2" else delta)
                ids = tok[pos:pos + B * T].view(B, T)
                tgt = tok[pos + 1:pos + B * T + 1].view(B, T)
                pos += B * T
                loss = loss_fn(saved_cfg, w, ids, tgt) / accum
                loss.backward()
                total += loss.item()
            per_step.append((total, torch.nn.utils.clip_grad_norm_(list(ad.values()), clip).item()))
            opt.step()
        return per_step, {k: p.detach().double() for k, p in ad.items()}

    ref_steps, ref = replay(torch.float64)
    worst_loss = worst_norm = 0.0
    for s, (total, norm) in enumerate(ref_steps):
        m = metrics[s]
        el = abs(m["loss"] - total) / max(1e-12, abs(total))
        en = abs(m["grad_norm"] - norm) / max(1e-12, norm)
        worst_loss, worst_norm = max(worst_loss, el), max(worst_norm, en)
        if not el <= 2e-4:
            failures.append(f"step {s + 1}: loss {m['loss']} vs torch {total}")
        if not en <= 2e-4:
            failures.append(f"step {s + 1}: grad_norm {m['grad_norm']} vs torch {norm}")
    worst_w = 0.0
    for k, v in ref.items():
        e = ((a1[k].double() - v).abs().max() / max(1e-12, v.abs().max())).item()
        worst_w = max(worst_w, e)
        if not e <= 2e-3:
            failures.append(f"{k}: max |strata - torch| / max|torch| = {e:.3g}")
    # --merge-adapter: each adapted weight is W + s·B·A in float64, rounded once to fp32.
    merged_dir = os.path.join(d, "merged")
    run_strata(strata, base_dir, shard, merged_dir, os.path.join(d, "mm.jsonl"),
               common + ["--adapter", os.path.join(d, "a"), "--merge-adapter", "--steps", "1", "--lr", "0"])
    merged = read_model_dir(merged_dir)
    off_by = 0
    for m in mods:
        delta = scale * (a1[f"base_model.model.{m}.lora_B.weight"].double() @ a1[f"base_model.model.{m}.lora_A.weight"].double())
        want = (base[m + ".weight"].double() + (delta.t() if cfg["model_type"] == "gpt2" else delta)).float()
        off_by += int((merged[m + ".weight"] != want).sum())
    for k in base:
        if not any(k == m + ".weight" for m in mods) and not torch.equal(merged[k], base[k]):
            failures.append(f"merged: {k} is not the base's")
    if off_by:
        failures.append(f"merged: {off_by} elements differ from W + s*B*A (float64, rounded once)")
    print(f"{name}: {len(mods)} adapted modules, PEFT files; {steps} steps, loss/grad-norm relative error at most "
          f"{worst_loss:.1e}/{worst_norm:.1e}; final adapters {worst_w:.1e}; base files unchanged; merged model = W + s·B·A")
    return failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strata", default=os.path.join(os.path.dirname(__file__), "..", "build", "bin", "strata"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in TARGETS:
            failures += [f"{name}: {f}" for f in check(name, CONFIGS[name], a.strata, tmp)]
    for f in failures:
        print("MISMATCH", f)
    print("lora_crosscheck:", "FAILED" if failures else "all checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
