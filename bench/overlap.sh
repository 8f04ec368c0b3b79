#!/usr/bin/env bash
# Issue 10's overlap figure for one offloaded `strata train` run: the NVMe bench right before and
# right after (write and read, 4 GiB each, on the first --nvme-path), the run's steps 2..N from
# --metrics, and step ÷ max(resident step, bytes written ÷ write bw + bytes read ÷ read bw) with
# each bench. This disk's bandwidth moves between benches, so both ratios are printed.
#   bench/overlap.sh BIN RESIDENT_MS -- TRAIN_ARGS...   (TRAIN_ARGS must include --nvme-path DIR)
set -euo pipefail
bin=$1 resident_ms=$2; shift 2
[[ "${1:-}" == "--" ]] && shift
args=("$@")
dir=""
for ((i = 0; i < ${#args[@]}; i++)); do [[ "${args[i]}" == "--nvme-path" ]] && dir=${args[i + 1]}; done
[[ -n "$dir" ]] || { echo "overlap.sh: TRAIN_ARGS need --nvme-path DIR" >&2; exit 2; }
field() { sed -E "s/.*\"$1\":([0-9.eE+-]+).*/\1/"; }
bench() { "$bin" bench io --path "$dir" --size 4G --mode "$1" | field mb_per_s; }
w0=$(bench write) r0=$(bench read)
metrics=$(mktemp)
trap 'rm -f "$metrics"' EXIT
"$bin" train "${args[@]}" --metrics "$metrics" >/dev/null
w1=$(bench write) r1=$(bench read)
# Steps 2..N: the first step starts cold.
awk -v w0="$w0" -v r0="$r0" -v w1="$w1" -v r1="$r1" -v res="$resident_ms" '
  function num(k) { return match($0, "\"" k "\":[0-9.eE+-]+") ? substr($0, RSTART + length(k) + 3, RLENGTH - length(k) - 3) + 0 : 0 }
  NR > 1 { n++; ms += num("step_ms"); busy += num("nvme_busy_ms"); wb += num("host_to_nvme_bytes"); rb += num("nvme_to_host_bytes") }
  END {
    if (n == 0) { print "overlap.sh: fewer than 2 steps in the metrics" > "/dev/stderr"; exit 2 }
    ms /= n; busy /= n; wb /= n; rb /= n
    f0 = wb / (w0 * 1e3) + rb / (r0 * 1e3); f1 = wb / (w1 * 1e3) + rb / (r1 * 1e3)   # ms (MB/s -> bytes/ms)
    if (f0 < res) f0 = res; if (f1 < res) f1 = res
    printf "steps 2..%d: %.0f ms/step, disk busy %.0f ms, written %.2f GB, read %.2f GB per step\n", n + 1, ms, busy, wb / 1e9, rb / 1e9
    printf "bench before: write %.0f, read %.0f MB/s -> floor %.0f ms, ratio %.2f\n", w0, r0, f0, ms / f0
    printf "bench after:  write %.0f, read %.0f MB/s -> floor %.0f ms, ratio %.2f\n", w1, r1, f1, ms / f1
  }' "$metrics"
