#!/usr/bin/env python3
"""PyTorch reference for issue 3's CPU figure: GPT-2 124M (random init), B=4, T=64, one
training step = forward, backward, torch.optim.AdamW, timed like `strata bench step`.

Written for the project (a nanoGPT-shaped model in plain torch; no transformers needed). Run with
Debian's python3-torch under /usr/bin/python3:

    /usr/bin/python3 bench/reference/torch_gpt2_step.py [--threads 2] [--warmup 2] [--steps 5]

and, for PyTorch's best settings on this machine, with the environment the issue names:

    OPENBLAS_CORETYPE=SkylakeX OMP_WAIT_POLICY=passive GLIBC_TUNABLES=glibc.malloc.hugetlb=1 \\
        /usr/bin/python3 bench/reference/torch_gpt2_step.py

Prints one JSON line: ms_per_step (mean), ms_per_step_median, tokens_per_s, adamw_ms (median).
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(c)
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)

    def forward(self, x, mask):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
        att = F.softmax(att.masked_fill(mask[:t, :t] == 0, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, vocab=50257, ctx=1024, c=768, layers=12, heads=12):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(ctx, c)
        self.h = nn.ModuleList(Block(c, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c)
        self.register_buffer("mask", torch.tril(torch.ones(ctx, ctx)))
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for blk in self.h:
            x = blk(x, self.mask)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied head
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 50257, (a.batch, a.seq), generator=g)
    tgt = torch.randint(0, 50257, (a.batch, a.seq), generator=g)
    times, adam = [], []
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(idx, tgt)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if i >= a.warmup:
            times.append((t2 - t0) * 1e3)
            adam.append((t2 - t1) * 1e3)
    ms = sum(times) / len(times)
    print(json.dumps({"bench": "torch_gpt2_step", "torch": torch.__version__, "threads": a.threads,
                      "batch": a.batch, "seq": a.seq, "params": sum(p.numel() for p in model.parameters()),
                      "ms_per_step": ms, "ms_per_step_median": statistics.median(times),
                      "tokens_per_s": a.batch * a.seq / (ms / 1e3), "adamw_ms": statistics.median(adam),
                      "loss": loss.item()}))


if __name__ == "__main__":
    main()
