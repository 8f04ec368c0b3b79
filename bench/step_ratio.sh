#!/usr/bin/env bash
# Paired precision comparison of `strata bench step` on a noisy (shared) machine: runs the fp32
# and the bf16 step benchmark alternately, PAIRS times, and prints each pair's median ms/step
# and their ratio, then the median ratio over pairs. Extra arguments go to both runs.
#   bench/step_ratio.sh [PAIRS] [-- extra bench-step flags]
# Default config: GPT-2 124M, B=4, T=64 (issue 3's figure).
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-5}
shift || true
[[ "${1:-}" == "--" ]] && shift
bin=build/bin/strata
[[ -x $bin ]] || { echo "step_ratio.sh: $bin not found; build first (scripts/test.sh or cmake --build build)" >&2; exit 1; }
args=(--preset gpt2-124m --batch 4 --seq 64 --warmup 2 --steps 7 "$@")
field() { sed -E "s/.*\"$1\":([0-9.eE+-]+).*/\1/"; }
ratios=()
for ((i = 1; i <= pairs; i++)); do
  f=$($bin bench step "${args[@]}" --dtype fp32 | field ms_per_step_median)
  b=$($bin bench step "${args[@]}" --dtype bf16 | field ms_per_step_median)
  r=$(awk -v f="$f" -v b="$b" 'BEGIN { printf "%.3f", f / b }')
  ratios+=("$r")
  printf 'pair %d: fp32 %.1f ms  bf16 %.1f ms  ratio %s\n' "$i" "$f" "$b" "$r"
done
printf '%s\n' "${ratios[@]}" | sort -n | awk '{ a[NR] = $1 } END { m = NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2; printf "median bf16/fp32 speed-up over %d pairs: %.3f\n", NR, m }'
