#!/usr/bin/env bash
# Installs what is missing, builds strata and trains the embedded default model (a byte-level
# llama, ~24M parameters) on the embedded corpus for about a minute, showing the loss fall.
# Extra arguments go to `strata train` (e.g. scripts/demo.sh --steps 200 --dtype bf16).
set -euo pipefail
STRATA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$STRATA_ROOT/scripts/common.sh"
BUILD_DIR="${BUILD_DIR:-$STRATA_ROOT/build}"

strata_install_deps
strata_build "$BUILD_DIR" -DSTRATA_BUILD_TESTS=OFF -DSTRATA_BUILD_BENCH=OFF
OUT_DIR="${OUT_DIR:-$BUILD_DIR/demo}"
mkdir -p "$OUT_DIR"
# The defaults of `strata train` are this demo: B=4 x T=128, 100 steps, lr 2e-3 cosine to 2e-4
# (about 35 s on 2 idle cores; the loss falls from ln 256 = 5.5 to about 1.8).
"$BUILD_DIR/bin/strata" train --log-every 5 --metrics "$OUT_DIR/metrics.jsonl" --out "$OUT_DIR/model" "$@"
echo "metrics: $OUT_DIR/metrics.jsonl   model (HF layout): $OUT_DIR/model"
