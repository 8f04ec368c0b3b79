#!/usr/bin/env bash
# Paired A/B of two strata binaries on `strata train` with a placement (bench/ab_step.sh times
# `bench step`, which has no placement flags): per pair, A's then B's run, each the median
# step_ms of steps 2..N from --metrics, and B/A; then the median ratio. Losses must agree.
#   bench/ab_train.sh BIN_A BIN_B [PAIRS] [-- train flags]   (default: gpt2-124m, all on NVMe)
set -euo pipefail
a=$1 b=$2; shift 2
pairs=5
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then pairs=$1; shift; fi
if [[ "${1:-}" == "--" ]]; then shift; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/swap"
args=(--preset gpt2-124m --batch 4 --seq 64 --steps 8 --offload-params nvme --offload-grads nvme
      --offload-optimizer nvme --host-mem 1G --nvme-path "$tmp/swap" "$@")
med_step() { awk -F'"step_ms":' 'NR > 1 { split($2, v, /[,}]/); print v[1] }' "$1" |
             sort -n | awk '{ x[NR] = $1 } END { print NR % 2 ? x[(NR + 1) / 2] : (x[NR / 2] + x[NR / 2 + 1]) / 2 }'; }
losses() { grep -o '"loss":[^,}]*' "$1"; }
source "$(dirname "$0")/ab_lib.sh"
pair() {
  rm -f "$tmp/a.jsonl" "$tmp/b.jsonl"
  "$a" train "${args[@]}" --metrics "$tmp/a.jsonl" > "$tmp/a.out" 2>&1 || { tail -3 "$tmp/a.out"; exit 1; }
  "$b" train "${args[@]}" --metrics "$tmp/b.jsonl" > "$tmp/b.out" 2>&1 || { tail -3 "$tmp/b.out"; exit 1; }
  if [[ "$(losses "$tmp/a.jsonl")" != "$(losses "$tmp/b.jsonl")" ]]; then echo "pair $1: the losses differ"; exit 1; fi
  MA=$(med_step "$tmp/a.jsonl") MB=$(med_step "$tmp/b.jsonl")
}
ab_pairs "$pairs" pair
echo "median B/A step time over $pairs pairs: $AB_MEDIAN (args: ${args[*]})"
