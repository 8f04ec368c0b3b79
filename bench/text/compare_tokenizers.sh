#!/bin/bash
# Encode throughput of strata's tokenizer beside Hugging Face's Rust `tokenizers` (the npm binding
# @anush008/tokenizers), on the same text and tokenizer.json, one thread each, in one run:
#   bench/text/compare_tokenizers.sh [MB] [STRATA_BIN] [NAME...]
# MB of generated mixed text (tests/text/fixtures/make_corpus.py --bench-mb, default 20); NAME
# from tests/text/fixtures/tokenizers (default llama3 qwen3 llama2). Needs node and npm (the
# binding is fetched into a scratch folder once) and python3; the test suite needs neither.
# Prints one JSON line per implementation and tokenizer, then a ratio table.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
MB="${1:-20}"
STRATA="${2:-$ROOT/build/bin/strata}"
shift $(( $# > 2 ? 2 : $# )) || true
NAMES=("$@")
[ ${#NAMES[@]} -eq 0 ] && NAMES=(llama3 qwen3 llama2)
WORK="${STRATA_BENCH_DIR:-/tmp/strata-tokenizer-bench}"
mkdir -p "$WORK"
if [ ! -d "$WORK/node_modules/@anush008/tokenizers" ]; then
  (cd "$WORK" && npm install --silent --no-audit --no-fund @anush008/tokenizers@0.6.0 >/dev/null)
fi
TEXT="$WORK/bench_${MB}mb.jsonl"
[ -f "$TEXT" ] || python3 "$ROOT/tests/text/fixtures/make_corpus.py" --bench-mb "$MB" --out "$TEXT"
for name in "${NAMES[@]}"; do
  dir="$WORK/tok_$name"
  mkdir -p "$dir"
  src="$ROOT/tests/text/fixtures/tokenizers/$name"
  if [ -f "$src/tokenizer.json.gz" ]; then
    gzip -dc "$src/tokenizer.json.gz" > "$dir/tokenizer.json"
  else
    echo "no $src/tokenizer.json.gz (derived tokenizers are not benchmarked)" >&2; continue
  fi
  NODE_PATH="$WORK/node_modules" node "$ROOT/bench/text/rust_tokenizers.js" "$dir/tokenizer.json" "$TEXT" | tee "$WORK/rust_$name.json"
  "$STRATA" bench tokenizer --tokenizer "$dir" --in "$TEXT" --threads 1 | tee "$WORK/strata_$name.json"
done
python3 - "$WORK" "${NAMES[@]}" <<'PY'
import json, sys, os
work = sys.argv[1]
print(f"{'tokenizer':<12}{'rust MB/s':>12}{'strata MB/s':>14}{'ratio':>8}")
for n in sys.argv[2:]:
    try:
        r = json.loads(open(os.path.join(work, f"rust_{n}.json")).read().splitlines()[0])
        s = json.loads(open(os.path.join(work, f"strata_{n}.json")).read())
    except (OSError, IndexError):
        continue
    print(f"{n:<12}{r['mb_per_s']:>12.2f}{s['mb_per_s']:>14.2f}{s['mb_per_s'] / r['mb_per_s']:>8.2f}")
PY
