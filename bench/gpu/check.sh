#!/usr/bin/env bash
# One GPU check for a lent device machine (H200, ~15 minutes of device time for all tries), in one
# call, printing ONE short table. In order of what it can find wrong:
#  1. the CUDA op tests (test_kernels' Cuda* suites: each op against the CPU backend), and the
#     NCCL communicator's one-rank tests (test_comm's Nccl* suites; where test_comm was built);
#  2. the offload invariants on the GPU: a small model trained with --backend cuda under several
#     placements (optimizer in pinned host RAM, everything on NVMe with checkpointing, a tight
#     device budget, grad accumulation 2) must give losses and grad norms BITWISE equal to the
#     resident GPU run, in bf16 and fp32; a resume from a step-2 checkpoint must too; 2 ranks
#     sharing the GPU (mpirun: the machine's, else the PREBUILT tarball's) at ZeRO stages 0-3
#     bitwise equal to each other; and the GPU run is compared with the CPU backend's (close,
#     not bitwise);
#  3. `strata bench ops --backend cuda`;
#  4. the 1B model resident, with the optimizer in host RAM, split by Twin-Flow
#     (--optimizer-on-device auto under 34 GiB), and under a 24 GiB device budget (optimizer and
#     weights in pinned host RAM, checkpointing), and `strata plan` for the 8B model under 24 GiB.
# Every step runs under `timeout` and the script carries on past failures. Logs go to $OUT.
#
# Usage (repository root, on the GPU machine):
#   bash bench/gpu/check.sh                      builds there (needs the build dependencies)
#   PREBUILT=.gpu/sg.tar.xz bash bench/gpu/check.sh
#     uses binaries built elsewhere: a tarball of sg/bin/{strata,test_kernels} and sg/lib/ (the
#     non-CUDA shared libraries they need); cuBLAS and the CUDA runtime come from the machine.
#     Make it with bench/gpu/pack.sh after a CUDA build (sm_90).
#   env: OUT=dir  BUILD_DIR=dir (default build-gpu)  REPS=n (bench repetitions, default 5)
#        STAGES="tests inv ops train nvme" (the default; any subset)  QUICK=1 (tests and inv only)  GPU_BACKEND=cpu (dry run of steps 1-2 without a GPU)
set -uo pipefail
OUT="${OUT:-/tmp/strata-gpu}"
BUILD_DIR="${BUILD_DIR:-build-gpu}"
REPS="${REPS:-5}"
STAGES="${STAGES:-tests inv ops train nvme}"
[ -n "${QUICK:-}" ] && STAGES="tests inv"
has() { case " $STAGES " in *" $1 "*) return 0 ;; esac; return 1; }
GB="${GPU_BACKEND:-cuda}"  # GPU_BACKEND=cpu dry-runs steps 1-2 on a machine without a GPU
mkdir -p "$OUT"
T0=$(date +%s)
STATUS=()  # "step rc seconds" lines for the summary

# step NAME SECONDS CMD...: runs CMD under a timeout, output to $OUT/NAME.log; never exits.
step() {
  local name="$1" limit="$2"; shift 2
  local t=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  STATUS+=("$(printf '%-16s rc=%-3s %4ss%s' "$name" "$rc" "$(( $(date +%s) - t ))" \
    "$([ "$rc" = 124 ] && echo "  (timed out after ${limit}s)")")")
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt" 2>&1
echo "gpu: $(cat "$OUT/gpu.txt")   host: $(nproc) cores, $(free -g | awk '/Mem:/ { print $2 }') GiB"

if [ -n "${PREBUILT:-}" ]; then
  rm -rf /tmp/sg && tar xJf "$PREBUILT" -C /tmp || { echo "cannot unpack $PREBUILT"; exit 1; }
  BIN=/tmp/sg/bin
  # cuBLAS / cudart of this machine: the toolkit's, else the Python wheels'.
  CUDA_LIBS=""
  for f in $( (ls /usr/local/cuda/lib64/libcublasLt.so.13 /usr/local/cuda/targets/x86_64-linux/lib/libcublasLt.so.13 \
              /usr/local/cuda/lib/libcublasLt.so.13 2>/dev/null; \
              find /opt /usr -name 'libcublasLt.so.13' 2>/dev/null) | head -3); do
    CUDA_LIBS="$CUDA_LIBS:$(dirname "$f")"
  done
  for f in $(find /opt /usr -name 'libcudart.so.13' 2>/dev/null | head -2); do CUDA_LIBS="$CUDA_LIBS:$(dirname "$f")"; done
  # NCCL (the strata of a build with NCCL loads it): the toolkit's, else the nvidia-nccl wheel's.
  ldconfig -p | grep -q 'libnccl\.so\.2 ' ||
    for f in $(find /opt /usr -name 'libnccl.so.2' 2>/dev/null | head -2); do CUDA_LIBS="$CUDA_LIBS:$(dirname "$f")"; done
  export LD_LIBRARY_PATH="/tmp/sg/lib$CUDA_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" > "$OUT/libs.log"
  ldd "$BIN/strata" "$BIN/test_kernels" >> "$OUT/libs.log" 2>&1
  if grep -q "not found" "$OUT/libs.log"; then echo "missing libraries:"; grep "not found" "$OUT/libs.log" | sort -u; fi
  # No mpirun here: the tarball's OpenMPI (bench/gpu/pack_ompi.sh), for the 2-rank checks.
  if ! command -v mpirun > /dev/null && [ -f /tmp/sg/ompi/env.sh ]; then
    source /tmp/sg/ompi/env.sh
    echo "mpirun: the tarball's ($(command -v mpirun))" >> "$OUT/libs.log"
  fi
else
  BIN="$BUILD_DIR/bin"
  step install 120 bash -c 'source scripts/common.sh; strata_install_deps'
  step configure 120 cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DSTRATA_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DSTRATA_BUILD_BENCH=OFF -DSTRATA_WERROR=OFF
  step build 330 cmake --build "$BUILD_DIR" -j "$(nproc)" --target test_kernels test_comm comm_mpi_test strata
fi
S="$BIN/strata"

# 1. The CUDA op tests.
has tests && step test_cuda 100 "$BIN/test_kernels" --gtest_brief=1 --gtest_filter='*Cuda*'
has tests && [ -x "$BIN/test_comm" ] && step test_nccl 60 "$BIN/test_comm" --gtest_brief=1 --gtest_filter='Nccl*'
# 2 ranks on this one GPU through the mpi communicator (device buffers staged through pinned host
# memory): every collective against the CPU reference, where mpirun is there.
has tests && [ -x "$BIN/comm_mpi_test" ] && command -v mpirun > /dev/null &&
  step test_mpi_staged 90 env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    OMPI_MCA_rmaps_base_oversubscribe=1 mpirun -np 2 "$BIN/comm_mpi_test"

# 2. Offload invariants on the GPU (small model, seconds each).
SWAP=/tmp/strata-swap
rm -rf "$SWAP" "$OUT"/inv_* && mkdir -p "$SWAP"
if has inv; then
INV=()  # "dtype name verdict" lines
INV_TIMEOUTS=0  # after two timed-out runs (a hang) the rest are not run: device time is short
losses() {  # the step, loss and grad norm of each metrics line, full precision
  grep -o '"grad_norm":[^,]*\|"loss":[^,]*\|"step":[^,]*' "$1" 2>/dev/null | paste -d' ' - - - ; }
inv() {  # inv DTYPE NAME REF ARGS...: trains 4 steps and compares with run REF of DTYPE (- = none)
  local dt="$1" name="$2" ref="$3"; shift 3
  if [ "$INV_TIMEOUTS" -ge 2 ]; then INV+=("$(printf '%-5s %-18s %s' "$dt" "$name" "not run: two runs timed out")"); return; fi
  step "inv_${dt}_$name" 30 "$S" train --backend "${BACKEND:-$GB}" --dtype "$dt" --batch 4 --seq 64 --steps 4 \
    --warmup 1 --log-every 1 --metrics "$OUT/inv_${dt}_$name.jsonl" "$@"
  local rc=$?
  local v a="$OUT/inv_${dt}_$ref.jsonl" b="$OUT/inv_${dt}_$name.jsonl"
  [ "$rc" = 124 ] && INV_TIMEOUTS=$((INV_TIMEOUTS + 1))
  if [ "$rc" != 0 ]; then v="FAILED rc=$rc: $(grep -v '^\s*$' "$OUT/inv_${dt}_$name.log" | tail -1 | cut -c1-110)"
  elif [ "$ref" = - ]; then v="losses $(losses "$b" | awk '{ printf "%s ", $2 }' | sed 's/"loss"://g')"
  elif cmp -s <(losses "$a") <(losses "$b"); then v="bitwise equal to $ref"
  else v="DIFFERS from $ref: max |loss difference| $(paste -d' ' <(losses "$a") <(losses "$b") | sed 's/"[a-z_]*"://g' |
      awk '{ d = $2 - $5; if (d < 0) d = -d; if (d > m) m = d } END { printf "%.3g", m }')"
  fi
  INV+=("$(printf '%-5s %-18s %s' "$dt" "$name" "$v")")
}
NV=(--nvme-path "$SWAP")
# AdamW on the GPU (optimizer none) and on the CPU (optimizer cpu/nvme) are different kernels:
# each placement is compared with the resident run of its optimizer's side.
for dt in bf16 fp32; do
  inv $dt resident - --grad-accum 2
  inv $dt params_grads_cpu resident --grad-accum 2 --offload-params cpu --offload-grads cpu
  inv $dt ckpt_acts_cpu resident --grad-accum 2 --checkpoint-activations full --offload-activations cpu
  inv $dt opt_cpu - --grad-accum 2 --offload-optimizer cpu
  inv $dt opt_cpu_vs_gpu resident --grad-accum 2 --offload-optimizer cpu
  inv $dt all_cpu opt_cpu --grad-accum 2 --offload-params cpu --offload-grads cpu --offload-optimizer cpu
  inv $dt all_nvme_ckpt opt_cpu --grad-accum 2 --offload-params nvme --offload-grads nvme --offload-optimizer nvme \
    --checkpoint-activations full --offload-activations cpu "${NV[@]}"
  inv $dt every2_acts_nvme opt_cpu --grad-accum 2 --offload-optimizer nvme --checkpoint-activations every:2 \
    --offload-activations nvme "${NV[@]}"
  inv $dt tight_device opt_cpu --grad-accum 2 --offload-params cpu --offload-grads cpu --offload-optimizer cpu \
    --checkpoint-activations full --device-mem 48M
  # Twin-Flow: part of AdamW on the GPU, the rest on the CPU: bitwise both ends (the two AdamW
  # kernels round alike, which opt_cpu_vs_gpu checks too).
  inv $dt twin_half opt_cpu --grad-accum 2 --offload-optimizer cpu --optimizer-on-device 0.5
  inv $dt twin_half_vs_gpu resident --grad-accum 2 --offload-optimizer cpu --optimizer-on-device 0.5
  inv $dt twin_nvme opt_cpu --grad-accum 2 --offload-optimizer nvme --optimizer-on-device 0.3 "${NV[@]}"
done
# Without clipping each unit updates in the backward (AdamW on the CPU beside the GPU's backward):
# placements must still agree bit for bit.
inv bf16 opt_cpu_clip0 - --grad-accum 2 --grad-clip 0 --offload-optimizer cpu
inv bf16 all_nvme_clip0 opt_cpu_clip0 --grad-accum 2 --grad-clip 0 --offload-params nvme --offload-grads nvme \
  --offload-optimizer nvme --checkpoint-activations full --offload-activations cpu "${NV[@]}"
# Resume: 2 steps with a checkpoint, then on to 4 from it, against the 4-step run.
rm -rf /tmp/strata-ckpt
step inv_resume_a 30 "$S" train --backend "$GB" --dtype bf16 --batch 4 --seq 64 --steps 4 --warmup 1 --grad-accum 2 \
  --offload-optimizer cpu --checkpoint-dir /tmp/strata-ckpt --checkpoint-every 2 --metrics "$OUT/inv_resume_a.jsonl"
ls /tmp/strata-ckpt > "$OUT/inv_resume_dirs.log" 2>&1
step inv_resume_b 30 "$S" train --backend "$GB" --dtype bf16 --batch 4 --seq 64 --steps 4 --warmup 1 --grad-accum 2 \
  --offload-optimizer cpu --checkpoint-dir /tmp/strata-ckpt --resume /tmp/strata-ckpt/step-00000002 \
  --metrics "$OUT/inv_resume_b.jsonl"
if cmp -s <(losses "$OUT/inv_resume_a.jsonl" | tail -2) <(losses "$OUT/inv_resume_b.jsonl" | tail -2) &&
   [ "$(losses "$OUT/inv_resume_b.jsonl" | wc -l)" -eq 2 ]; then INV+=("bf16  resume_from_step2  bitwise equal (steps 3-4)")
else INV+=("bf16  resume_from_step2  DIFFERS or failed: see inv_resume_*.log"); fi
# 2 ranks sharing this GPU (the mpi communicator, device buffers staged through pinned host
# memory): ZeRO stages 0-3 bitwise equal to each other, and close to 1 rank with the double batch.
if command -v mpirun > /dev/null; then
  MPI_ENV=(env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1)
  step inv_mpi_one 30 "$S" train --backend "$GB" --dtype bf16 --batch 8 --seq 64 --steps 4 --warmup 1 \
    --metrics "$OUT/inv_mpi_one.jsonl"
  for z in 0 1 2 3; do
    step inv_mpi_z$z 60 "${MPI_ENV[@]}" mpirun -np 2 "$S" train --backend "$GB" --dtype bf16 --batch 4 --seq 64 \
      --steps 4 --warmup 1 --zero-stage $z --metrics "$OUT/inv_mpi_z$z.jsonl"
    if [ ! -s "$OUT/inv_mpi_z$z.jsonl" ]; then v="FAILED: $(grep -v '^\s*$' "$OUT/inv_mpi_z$z.log" | tail -1 | cut -c1-100)"
    elif [ "$z" = 0 ]; then v="max |loss - 1 rank x batch 8| $(paste -d' ' <(losses "$OUT/inv_mpi_one.jsonl") <(losses "$OUT/inv_mpi_z0.jsonl") |
        sed 's/"[a-z_]*"://g' | awk '{ d = $2 - $5; if (d < 0) d = -d; if (d > m) m = d } END { printf "%.3g", m }')"
    elif cmp -s <(losses "$OUT/inv_mpi_z0.jsonl") <(losses "$OUT/inv_mpi_z$z.jsonl"); then v="bitwise equal to stage 0"
    else v="DIFFERS from stage 0"; fi
    INV+=("$(printf '%-5s %-18s %s' bf16 "2ranks_1gpu_z$z" "$v")")
  done
else
  INV+=("bf16  2ranks_1gpu        not run: no mpirun on this machine")
fi
# The CPU backend on the same run: close to the GPU's, not bitwise.
BACKEND=cpu inv bf16 cpu_backend opt_cpu --grad-accum 2 --offload-optimizer cpu
rm -rf "$SWAP"/* /tmp/strata-ckpt
fi

# 3. Op throughput.
has ops && step bench_ops 75 "$S" bench ops --backend cuda --reps "$REPS"
# 4. The 1B model (16k tokens per step) resident, with the optimizer in host RAM, and under a
# 24 GiB device budget; each offloaded run next to `strata plan`'s prediction; the 8B plan.
TRAIN=("$S" train --backend "$GB" --dtype bf16 --log-every 1)
B1=(${B1_ARGS:---preset llama-1b --batch 8 --seq 2048})  # B1_ARGS: another model or shape (dry runs)
PLANS=()
if has train; then
  step train_1b 80 "${TRAIN[@]}" "${B1[@]}" --steps 5 --metrics "$OUT/train_1b.jsonl"
  # The plan probes the model's phases on this GPU: each phase's TFLOP/s and share of the peak.
  step plan_1b 40 "$S" plan --backend "$GB" --dtype bf16 "${B1[@]}"
  step train_1b_opt_cpu 90 "${TRAIN[@]}" "${B1[@]}" --steps 4 --offload-optimizer cpu --metrics "$OUT/train_1b_opt_cpu.jsonl"
  step plan_1b_opt_cpu 40 "$S" plan --backend "$GB" --dtype bf16 "${B1[@]}" --offload-optimizer cpu
  step train_1b_opt_cpu_clip0 90 "${TRAIN[@]}" "${B1[@]}" --steps 4 --offload-optimizer cpu --grad-clip 0 \
    --metrics "$OUT/train_1b_opt_cpu_clip0.jsonl"
  # Twin-Flow: the split the plan picks under a device budget that cannot hold the whole optimizer
  # (the resident 1B needs ~40 GiB; issue 28: step <= 1.3x the resident one).
  step train_1b_twin 90 "${TRAIN[@]}" "${B1[@]}" --steps 4 --offload-optimizer cpu --optimizer-on-device auto \
    --device-mem 34G --metrics "$OUT/train_1b_twin.jsonl"
  step plan_1b_twin 40 "$S" plan --backend "$GB" --dtype bf16 "${B1[@]}" --offload-optimizer cpu \
    --optimizer-on-device auto --device-mem 34G
  step train_1b_24g 90 "${TRAIN[@]}" "${B1[@]}" --steps 4 --device-mem 24G \
    --offload-optimizer cpu --offload-params cpu --checkpoint-activations full --metrics "$OUT/train_1b_24g.jsonl"
  step plan_1b_24g 40 "$S" plan --backend "$GB" --dtype bf16 "${B1[@]}" --device-mem 24G \
    --offload-optimizer cpu --offload-params cpu --checkpoint-activations full
  step plan_8b 40 "$S" plan --backend "$GB" --dtype bf16 --preset llama-8b --batch 1 --seq 2048 \
    --device-mem 24G --offload-optimizer cpu --offload-grads cpu --offload-params nvme --checkpoint-activations full \
    --nvme-path "$SWAP"
  PLANS+=(train_1b:plan_1b train_1b_opt_cpu:plan_1b_opt_cpu train_1b_twin:plan_1b_twin train_1b_24g:plan_1b_24g)
fi
# 5. The optimizer state on this machine's disk: the io bench right before, the run, its plan.
if has nvme; then
  mkdir -p "$SWAP"
  step bench_io_w 40 "$S" bench io --path "$SWAP" --size 4G --mode write
  step bench_io_r 40 "$S" bench io --path "$SWAP" --size 4G --mode read
  step train_1b_opt_nvme 150 "${TRAIN[@]}" "${B1[@]}" --steps 3 --offload-optimizer nvme --host-mem 6G --nvme-path "$SWAP" \
    --metrics "$OUT/train_1b_opt_nvme.jsonl"
  step plan_1b_opt_nvme 40 "$S" plan --backend "$GB" --dtype bf16 "${B1[@]}" --offload-optimizer nvme --host-mem 6G --nvme-path "$SWAP"
  PLANS+=(train_1b_opt_nvme:plan_1b_opt_nvme)
fi
rm -rf "$SWAP"

# ---- the table ----------------------------------------------------------------------------------
field() {  # field JSON_LINE KEY: the value of KEY (string or number), empty when absent
  echo "$1" | grep -o "\"$2\":\(\"[^\"]*\"\|[^,}]*\)" | head -1 | cut -d: -f2- | tr -d '"'
}
echo
echo "== steps (logs in $OUT)"
printf '%s\n' "${STATUS[@]}"
echo
has tests && echo "== CUDA op tests"
has tests && grep -E "^\[  (PASSED|FAILED|SKIPPED) \]|tests? ran" "$OUT/test_cuda.log" | head -10 || true
has tests && grep -E "^\[  FAILED  \]" "$OUT/test_cuda.log" | head -20
has tests && grep -B3 -E "^\[  FAILED  \]" "$OUT/test_cuda.log" | grep -v "^\[" | head -20 || true
has tests && [ -f "$OUT/test_mpi_staged.log" ] && { echo "== 2 ranks on one GPU, mpi with staged device buffers (comm_mpi_test)";
  grep -E "device_buffers|error|check failed" "$OUT/test_mpi_staged.log" | head -5; }
echo
has inv && echo "== offload invariants on the GPU (4 steps, accum 2; each against the run it names)"
has inv && printf '%s\n' "${INV[@]}"
if has ops; then
echo
echo "== strata bench ops --backend cuda (ratio: our throughput / bare cuBLASLt; % of the device's peak)"
printf '%-30s %-26s %9s %10s %10s %7s %7s\n' op shape ms TFLOP/s GB/s ratio %peak
if [ -s "$OUT/bench_ops.log" ]; then
  while IFS= read -r l; do
    case "$l" in \{*) ;; *) continue ;; esac
    name=$(field "$l" name)
    [ "${name#cublaslt_bare}" != "$name" ] && continue  # the reference's own lines: see the log
    err=$(field "$l" error)
    if [ -n "$err" ]; then printf '%-30s %-26s ERROR %s\n' "$name" "$(field "$l" shape)" "${err:0:60}"; continue; fi
    printf '%-30s %-26s %9s %10s %10s %7s %7s\n' "$name" "$(field "$l" shape)" "$(field "$l" ms)" \
      "$(field "$l" tflops)" "$(field "$l" gb_per_s)" "$(field "$l" ratio)" "$(field "$l" pct_peak)"
  done < "$OUT/bench_ops.log"
fi
fi
echo
echo "== strata train --backend cuda (median of the steps after the first; MFU = 6·params·tokens/s over"
echo "   989 TFLOP/s, the H200's dense bf16 peak, attention FLOPs not counted; MFU+att: the plan's step FLOPs"
echo "   (matmuls, causal attention, recompute) over the step time, where the run has a plan)"
printf '%-22s %9s %6s %7s %8s %8s %8s %8s %s\n' run tokens/s MFU MFU+att step_ms plan_ms h2d_GB nvme_GB start-up
med() { sort -g | awk '{ a[NR] = $1 } END { if (NR) print a[int((NR + 1) / 2)] }'; }
for run in train_1b train_1b_opt_cpu train_1b_opt_cpu_clip0 train_1b_twin train_1b_24g train_1b_opt_nvme; do
  [ -f "$OUT/$run.log" ] || continue
  if [ -s "$OUT/$run.jsonl" ]; then
    tps=$(grep -o '"tokens_per_s":[0-9.eE+-]*' "$OUT/$run.jsonl" | tail -n +2 | cut -d: -f2 | med)
    sms=$(grep -o '"step_ms":[0-9.eE+-]*' "$OUT/$run.jsonl" | tail -n +2 | cut -d: -f2 | med)
    h2d=$(grep -o '"h2d_bytes":[0-9]*' "$OUT/$run.jsonl" | tail -1 | cut -d: -f2)
    nv=$(grep -o '"nvme_bytes":[0-9]*' "$OUT/$run.jsonl" | tail -1 | cut -d: -f2)
    params=$(grep -o 'params  *[0-9.]*[KMB]' "$OUT/$run.log" | head -1 | awk '{ v = $2; u = substr(v, length(v)); v = substr(v, 1, length(v) - 1);
             print v * (u == "B" ? 1e9 : u == "M" ? 1e6 : 1e3) }')
    mfu=$(awk -v t="${tps:-0}" -v p="${params:-0}" 'BEGIN { printf "%.1f%%", 600 * p * t / 989e12 }')
    plan=- mfua=-
    for pr in "${PLANS[@]}"; do
      [ "${pr%%:*}" = "$run" ] || continue
      plan=$(grep -o '^predicted step: [0-9]*' "$OUT/${pr#*:}.log" 2>/dev/null | grep -o '[0-9]*$')
      tf=$(grep -o '^compute  *[0-9.]* TFLOP' "$OUT/${pr#*:}.log" 2>/dev/null | grep -o '[0-9.]* TFLOP' | cut -d' ' -f1)
      [ -n "$tf" ] && mfua=$(awk -v f="$tf" -v ms="${sms:-0}" 'BEGIN { if (ms > 0) printf "%.1f%%", 100 * f * 1e12 / (ms / 1e3) / 989e12; else print "-" }')
    done
    printf '%-22s %9.0f %6s %7s %8.1f %8s %8.2f %8.2f %s\n' "$run" "${tps:-0}" "$mfu" "$mfua" "${sms:-0}" "${plan:--}" \
      "$(awk -v b="${h2d:-0}" 'BEGIN { print b / 1e9 }')" "$(awk -v b="${nv:-0}" 'BEGIN { print b / 1e9 }')" \
      "$(grep -o 'start-up *[0-9.]* s' "$OUT/$run.log" | head -1 | sed 's/start-up *//')"
  else
    printf '%-22s %9s %6s %s\n' "$run" - - "$(grep -v '^\s*$' "$OUT/$run.log" 2>/dev/null | tail -1 | cut -c1-110)"
  fi
done
for b in bench_io_w bench_io_r; do [ -s "$OUT/$b.log" ] && echo "$b: $(grep -o '"mb_per_s":[0-9.]*' "$OUT/$b.log" | head -1)"; done
for p in plan_1b plan_1b_opt_cpu plan_1b_twin plan_1b_24g plan_1b_opt_nvme plan_8b; do
  grep -E "^predicted|^phases|^adamw|^compute|^host_to|^nvme_to|^optimizer on device|error" "$OUT/$p.log" 2>/dev/null | head -8 |
    sed "s/^/$p: /"
done
echo
echo "total: $(( $(date +%s) - T0 ))s"
# One file back (the device tool returns at most 8): every log in a tarball.
tar czf "$OUT/logs.tar.gz" -C "$OUT" --exclude=logs.tar.gz --exclude=summary.txt . 2>/dev/null
[ -s "$OUT/logs.tar.gz" ] && find "$OUT" -maxdepth 1 -type f ! -name logs.tar.gz ! -name summary.txt -delete
