#!/usr/bin/env bash
# Installs what is missing, builds strata and trains the embedded default model (a byte-level
# llama, ~24M parameters) on the embedded corpus for about a minute, showing the loss fall —
# with the AdamW state (fp32 master, m, v) on NVMe under the build folder and activation
# checkpointing on, as a model bigger than memory would run: the header's tier table shows
# what lives where, each progress line the bytes moved. A training checkpoint is written at the
# end (resume with --resume auto --steps N). Extra arguments go to `strata train` (e.g.
# scripts/demo.sh --steps 200 --dtype bf16, or --offload-optimizer none for all in memory).
set -euo pipefail
STRATA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$STRATA_ROOT/scripts/common.sh"
BUILD_DIR="${BUILD_DIR:-$STRATA_ROOT/build}"

strata_install_deps
strata_build "$BUILD_DIR" -DSTRATA_BUILD_TESTS=OFF -DSTRATA_BUILD_BENCH=OFF
OUT_DIR="${OUT_DIR:-$BUILD_DIR/demo}"
SWAP_DIR="${SWAP_DIR:-$BUILD_DIR/demo-swap}"
mkdir -p "$OUT_DIR" "$SWAP_DIR"
# The defaults of `strata train` are this demo: B=4 x T=128, 100 steps, lr 2e-3 cosine to 2e-4
# (about 40 s on 2 idle cores; the loss falls from ln 256 = 5.5 to about 1.8).
# A 96 MiB host budget holds a few units' AdamW state, so every step streams the rest through
# NVMe (about 410 MiB each way per step) while the forward and backward compute.
"$BUILD_DIR/bin/strata" train --log-every 5 --offload-optimizer nvme --nvme-path "$SWAP_DIR" --host-mem 96M \
  --checkpoint-activations full --checkpoint-dir "$OUT_DIR/checkpoints" \
  --metrics "$OUT_DIR/metrics.jsonl" --out "$OUT_DIR/model" "$@"
echo "metrics: $OUT_DIR/metrics.jsonl   model (HF layout): $OUT_DIR/model   checkpoint: $OUT_DIR/checkpoints"

# Fine-tuning on conversations (README "Fine-tuning on conversations"): the shipped set through the
# byte-level tokenizer and its ChatML template, packed rows with a loss mask and a held-out set,
# then a sample from the model before and after.
S="$BUILD_DIR/bin/strata"
BYTES="$STRATA_ROOT/tests/text/fixtures/tokenizers/bytes"
cp "$BYTES/tokenizer.json" "$BYTES/tokenizer_config.json" "$OUT_DIR/model/"
rm -rf "$OUT_DIR/sft-data" "$OUT_DIR/sft-model"
"$S" data --tokenizer "$BYTES" --in "$STRATA_ROOT/examples/sft/conversations.jsonl" --format chat --val-docs 40 \
  --quiet --out "$OUT_DIR/sft-data"
QUESTION="What is the opposite of warm?"
echo "--- before fine-tuning: $QUESTION"
"$S" generate --model "$OUT_DIR/model" --chat --prompt "$QUESTION" --temperature 0 --max-new-tokens 40 --stop "<|im_end|>"
echo
"$S" train --model "$OUT_DIR/model" --data "$OUT_DIR/sft-data/train_*.bin" --val-data "$OUT_DIR/sft-data/val_*.bin" \
  --pack on --shuffle --seq 256 --batch 4 --steps 150 --lr 1e-3 --warmup 10 --eval-every 50 --log-every 25 \
  --metrics "$OUT_DIR/sft-metrics.jsonl" --out "$OUT_DIR/sft-model"
echo "--- after fine-tuning: $QUESTION"
"$S" generate --model "$OUT_DIR/sft-model" --chat --prompt "$QUESTION" --temperature 0 --max-new-tokens 40 --stop "<|im_end|>"
echo
