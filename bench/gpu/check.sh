#!/usr/bin/env bash
# One GPU check for a lent device machine (H200, ~15 minutes of device time for all tries): build
# for sm_90, run test_kernels (the CUDA op tests run instead of skipping), then
# `strata bench ops --backend cuda` and three `strata train --backend cuda` runs (1B all on the
# GPU; 1B under a 24 GiB budget with optimizer and weights in pinned host RAM; 8B under 24 GiB
# with weights on NVMe, next to `strata plan`'s prediction), and print ONE short table. Every step runs under `timeout`
# and the script carries on past failures; the build dominates (a few minutes on 16 cores), the
# train runs add at most 9 minutes of timeouts: run it with timeout_s 600 and expect ~8–10 minutes.
# Full logs go to $OUT (default /tmp/strata-gpu).
# Usage (repository root, on the GPU machine): bash bench/gpu/check.sh
#   env: OUT=dir  BUILD_DIR=dir (default build-gpu)  REPS=n (bench repetitions, default 10)
set -uo pipefail
OUT="${OUT:-/tmp/strata-gpu}"
BUILD_DIR="${BUILD_DIR:-build-gpu}"
REPS="${REPS:-10}"
mkdir -p "$OUT"
T0=$(date +%s)
STATUS=()  # "step rc seconds" lines for the summary

# step NAME SECONDS CMD...: runs CMD under a timeout, output to $OUT/NAME.log; never exits.
step() {
  local name="$1" limit="$2"; shift 2
  local t=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  STATUS+=("$(printf '%-14s rc=%-3s %4ss%s' "$name" "$rc" "$(( $(date +%s) - t ))" \
    "$([ "$rc" = 124 ] && echo "  (timed out after ${limit}s)")")")
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt" 2>&1
echo "gpu: $(cat "$OUT/gpu.txt")"

# Dependencies: only if something is missing (the machine may have no network).
step install 120 bash -c 'source scripts/common.sh; strata_install_deps'

step configure 120 cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DSTRATA_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DSTRATA_BUILD_BENCH=OFF -DSTRATA_WERROR=OFF
step build 330 cmake --build "$BUILD_DIR" -j "$(nproc)" --target test_kernels strata

# All kernel tests: the CPU ones (quick on 16 cores) and the CUDA ones against them.
step test_kernels 200 "$BUILD_DIR/bin/test_kernels" --gtest_brief=1
step bench_ops 200 "$BUILD_DIR/bin/strata" bench ops --backend cuda --reps "$REPS"
cp "$OUT/bench_ops.log" "$OUT/bench_ops.jsonl" 2>/dev/null

# --- training runs: the issue's three figures. ~16k tokens per step for the 1B runs; short runs,
# each under its own timeout (the 8B one may stop at the plan check: its error is the figure).
SWAP="${SWAP:-$OUT/swap}"
mkdir -p "$SWAP"
TRAIN=("$BUILD_DIR/bin/strata" train --backend cuda --dtype bf16 --log-every 1)
step train_1b 150 "${TRAIN[@]}" --preset llama-1b --batch 8 --seq 2048 --steps 6 --metrics "$OUT/train_1b.jsonl"
step train_1b_24g 150 "${TRAIN[@]}" --preset llama-1b --batch 8 --seq 2048 --steps 4 --device-mem 24G \
  --offload-optimizer cpu --offload-params cpu --checkpoint-activations full --metrics "$OUT/train_1b_24g.jsonl"
step plan_8b 60 "$BUILD_DIR/bin/strata" plan --backend cuda --dtype bf16 --preset llama-8b --batch 1 --seq 2048 \
  --device-mem 24G --offload-optimizer cpu --offload-params nvme --checkpoint-activations full --nvme-path "$SWAP"
step train_8b 180 "${TRAIN[@]}" --preset llama-8b --batch 1 --seq 2048 --steps 2 --device-mem 24G \
  --offload-optimizer cpu --offload-params nvme --checkpoint-activations full --nvme-path "$SWAP" \
  --metrics "$OUT/train_8b.jsonl"

# ---- the table ----------------------------------------------------------------------------------
field() {  # field JSON_LINE KEY: the value of KEY (string or number), empty when absent
  echo "$1" | grep -o "\"$2\":\(\"[^\"]*\"\|[^,}]*\)" | head -1 | cut -d: -f2- | tr -d '"'
}
echo
echo "== steps (logs in $OUT)"
printf '%s\n' "${STATUS[@]}"
echo
echo "== test_kernels"
grep -E "^\[  (PASSED|FAILED|SKIPPED) \]|tests ran" "$OUT/test_kernels.log" | head -30 || true
grep -E "^\[  FAILED  \]" "$OUT/test_kernels.log" | head -20 || true
echo
echo "== strata bench ops --backend cuda (ratio: our throughput / bare cuBLASLt; % of the device's peak)"
printf '%-30s %-26s %9s %10s %10s %7s %7s\n' op shape ms TFLOP/s GB/s ratio %peak
if [ -s "$OUT/bench_ops.jsonl" ]; then
  while IFS= read -r l; do
    case "$l" in \{*) ;; *) continue ;; esac
    name=$(field "$l" name)
    [ "${name#cublaslt_bare}" != "$name" ] && continue  # the reference's own lines: see the log
    err=$(field "$l" error)
    if [ -n "$err" ]; then printf '%-30s %-26s ERROR %s\n' "$name" "$(field "$l" shape)" "${err:0:60}"; continue; fi
    printf '%-30s %-26s %9s %10s %10s %7s %7s\n' "$name" "$(field "$l" shape)" "$(field "$l" ms)" \
      "$(field "$l" tflops)" "$(field "$l" gb_per_s)" "$(field "$l" ratio)" "$(field "$l" pct_peak)"
  done < "$OUT/bench_ops.jsonl"
else
  echo "(no bench output: see $OUT/bench_ops.log and $OUT/build.log)"
fi
echo
echo "== strata train --backend cuda (tokens/s: median of the steps after the first; MFU = 6·params·tokens/s"
echo "   over 989 TFLOP/s, the H200's dense bf16 peak, attention FLOPs not counted)"
printf '%-14s %12s %8s %s\n' run tokens/s MFU note
for run in train_1b train_1b_24g train_8b; do
  if [ -s "$OUT/$run.jsonl" ]; then
    tps=$(grep -o '"tokens_per_s":[0-9.eE+-]*' "$OUT/$run.jsonl" | tail -n +2 | cut -d: -f2 | sort -g |
          awk '{ a[NR] = $1 } END { if (NR) print a[int((NR + 1) / 2)] }')
    params=$(grep -o 'params     [0-9.]*[KMB]' "$OUT/$run.log" | head -1 | awk '{ v = $2; u = substr(v, length(v)); v = substr(v, 1, length(v) - 1);
             print v * (u == "B" ? 1e9 : u == "M" ? 1e6 : 1e3) }')
    mfu=$(awk -v t="${tps:-0}" -v p="${params:-0}" 'BEGIN { printf "%.1f%%", 600 * p * t / 989e12 }')
    printf '%-14s %12s %8s %s\n' "$run" "${tps:-?}" "$mfu" ""
  else
    printf '%-14s %12s %8s %s\n' "$run" - - "$(tail -1 "$OUT/$run.log" 2>/dev/null | cut -c1-100)"
  fi
done
grep -E "^predicted step" "$OUT/plan_8b.log" 2>/dev/null | sed 's/^/plan_8b: /'
echo
echo "total: $(( $(date +%s) - T0 ))s"
