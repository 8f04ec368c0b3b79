#!/usr/bin/env bash
# One GPU check for a lent device machine: build with CUDA for sm_90, run every test (the CUDA
# ones run instead of skipping), then the op and step benches, and print a short table.
# Usage (repository root, on the GPU machine): bash bench/gpu/check.sh   (OUT=dir keeps logs)
set -uo pipefail
OUT="${OUT:-/tmp/strata-gpu}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
STRATA_ROOT="$PWD"; source scripts/common.sh
strata_install_deps > "$OUT/install.log" 2>&1
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DSTRATA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  > "$OUT/configure.log" 2>&1 && cmake --build build-gpu -j "$(nproc)" > "$OUT/build.log" 2>&1
echo "build: rc=$?"
(cd build-gpu && ctest -j 8 --output-on-failure > "$OUT/ctest.log" 2>&1; echo "ctest: rc=$?")
tail -3 "$OUT/ctest.log"
grep -E "CudaRuntime\.[A-Za-z]+ .*(Passed|Failed|Skipped|Not Run)" "$OUT/ctest.log" || true
build-gpu/bin/test_kernels --gtest_filter='CudaRuntime.*' 2>&1 | tail -5
timeout 300 build-gpu/bin/strata bench ops --reps 5 --filter matmul > "$OUT/bench_ops.jsonl" 2>&1
timeout 300 build-gpu/bin/strata bench step --preset gpt2-124m --batch 4 --seq 64 --warmup 1 --steps 3 \
  > "$OUT/bench_step_cpu.jsonl" 2>&1
printf '%-28s %s\n' "case" "result"
while IFS= read -r l; do printf '%-28s %s\n' "$(echo "$l" | grep -o '"name":"[^"]*"')" "$(echo "$l" | grep -o '"gflops":[0-9.]*')"; done < "$OUT/bench_ops.jsonl"
cat "$OUT/bench_step_cpu.jsonl"
