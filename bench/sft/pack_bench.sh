#!/usr/bin/env bash
# Packing's gain (issue "Train on conversations"): trained targets per second of `strata train`
# with documents of mixed length (30-600 tokens, uniform, byte-level) at --seq 2048, one document
# per row (--pack off) against packed rows (--pack on), on the embedded default model's shape
# (byte-level llama, 8 x 512) with 2048 positions (random init; CPU).
# Usage: bench/sft/pack_bench.sh [BUILD_DIR] [STEPS]. Prints one JSON line per run and the ratio.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:-$ROOT/build}"
STEPS="${2:-6}"
S="$BUILD/bin/strata"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# 3000 documents of 30-600 bytes of the embedded corpus's kind of text (fixed seed).
python3 - "$WORK/docs.jsonl" <<'PY'
import json, random, sys
r = random.Random(2026)
words = "the small quiet river lantern garden engine letter bridge kettle map window orchard was near found".split()
with open(sys.argv[1], "w") as f:
    for _ in range(3000):
        n = r.randint(30, 600) - 2  # the byte tokenizer adds no BOS; EOS is appended
        text = ""
        while len(text) < n:
            text += r.choice(words) + " "
        f.write(json.dumps({"text": text[:n]}) + "\n")
PY
mkdir -p "$WORK/model"
cat > "$WORK/model/config.json" <<'JSON'
{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 512,
 "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
 "intermediate_size": 1408, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
 "tie_word_embeddings": false, "hidden_act": "silu"}
JSON
"$S" data --tokenizer "$ROOT/tests/text/fixtures/tokenizers/bytes" --in "$WORK/docs.jsonl" --out "$WORK/data" --quiet
for pack in off on; do
  "$S" train --model "$WORK/model" --data "$WORK/data/train_*.bin" --seq 2048 --batch 1 --steps "$STEPS" --warmup 1 --pack "$pack" \
    --metrics "$WORK/$pack.jsonl" >/dev/null
  # Steps after the first: trained targets over their wall time.
  python3 - "$WORK/$pack.jsonl" "$pack" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])][1:]
trained = sum(l["trained_tokens"] for l in lines)
ms = sum(l["step_ms"] for l in lines)
print(json.dumps({"pack": sys.argv[2], "steps": len(lines), "trained_tokens": trained, "ms": round(ms, 1),
                  "trained_tokens_per_s": round(trained / (ms / 1e3), 1),
                  "tokens_per_s": round(sum(l["tokens_per_s"] for l in lines) / len(lines), 1)}))
PY
done | tee "$WORK/runs.jsonl"
python3 - "$WORK/runs.jsonl" <<'PY'
import json, sys
r = {j["pack"]: j for j in map(json.loads, open(sys.argv[1]))}
print(json.dumps({"packed_over_unpacked_trained_tokens_per_s": round(r["on"]["trained_tokens_per_s"] / r["off"]["trained_tokens_per_s"], 2)}))
PY
