#!/usr/bin/env bash
# One GPU check for a lent device machine (H200, ~15 minutes of device time for all tries): build
# for sm_90, run test_kernels (the CUDA op tests run instead of skipping), then
# `strata bench ops --backend cuda`, and print ONE short table. Every step runs under `timeout`
# and the script carries on past failures; the whole run is meant to finish in under 8 minutes.
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

# --- training runs (placeholders: the integrator enables these once `strata train --backend cuda`
# --- runs end to end; keep the total under the 8-minute budget) -----------------------------------
# step train_1b 240 "$BUILD_DIR/bin/strata" train --backend cuda --preset llama-1b --batch 4 --seq 2048 \
#   --steps 20 --metrics "$OUT/train_1b.jsonl"
# step train_1b_offload 240 "$BUILD_DIR/bin/strata" train --backend cuda --preset llama-1b --batch 4 \
#   --seq 2048 --steps 10 --offload ... --metrics "$OUT/train_1b_offload.jsonl"

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
echo "total: $(( $(date +%s) - T0 ))s"
