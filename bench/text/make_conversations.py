#!/usr/bin/env python3
"""Writes a JSONL of synthetic conversations ({"messages": [...]}) of about --mb megabytes, for
`strata data --format chat` throughput and memory runs (bench/RESULTS.md). Deterministic (seeded);
a mix of English, code, digits, CJK and emoji, 1-4 user/assistant turn pairs, half with a system
message. Usage: make_conversations.py --mb 1000 --out /tmp/chats.jsonl"""
import argparse, json, random

WORDS = ("the of and to in is was for that with as on by it at from his her this which be or are an not "
         "model train token data memory disk thread shard value gradient optimizer layer weight batch learning "
         "rate loss step python code function return class import while true false none error file line").split()
EXTRA = ["数据", "模型", "训练", "こんにちは", "世界", "안녕하세요", "😀", "👩‍💻", "café", "naïve", "Straße",
         "1234567", "3.14159", "x = f(y) + 2;", "    return x\n", "it's", "they're", "we'll"]

def sentence(rng, n):
    out = []
    for _ in range(n):
        out.append(rng.choice(EXTRA) if rng.random() < 0.08 else rng.choice(WORDS))
    s = " ".join(out)
    return s[:1].upper() + s[1:] + rng.choice([".", "?", "!", ".\n"])

def text(rng, lo, hi):
    return " ".join(sentence(rng, rng.randint(5, 25)) for _ in range(rng.randint(lo, hi)))

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=100)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    limit = int(a.mb * 1e6)
    written = 0
    with open(a.out, "w", encoding="utf-8") as f:
        while written < limit:
            msgs = []
            if rng.random() < 0.5:
                msgs.append({"role": "system", "content": text(rng, 1, 2)})
            for _ in range(rng.randint(1, 4)):
                msgs.append({"role": "user", "content": text(rng, 1, 4)})
                msgs.append({"role": "assistant", "content": text(rng, 2, 12)})
            line = json.dumps({"messages": msgs}, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode())

if __name__ == "__main__":
    main()
