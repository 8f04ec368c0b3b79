#!/usr/bin/env bash
# Paired A/B comparison of two strata binaries on `strata bench step` (a shared machine swings
# by ±15%, so runs alternate and ratios are per pair): prints each pair's median ms/step and
# B/A, then the median ratio. Used for "resident costs nothing" (before/after a change).
#   bench/ab_step.sh BIN_A BIN_B [PAIRS] [-- extra bench-step flags]
set -euo pipefail
a=$1 b=$2; shift 2
pairs=5
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then pairs=$1; shift; fi
if [[ "${1:-}" == "--" ]]; then shift; fi
args=(--preset gpt2-124m --batch 4 --seq 64 --warmup 2 --steps 7 "$@")
field() { sed -E "s/.*\"$1\":([0-9.eE+-]+).*/\1/"; }
ratios=()
for ((i = 1; i <= pairs; i++)); do
  ja=$($a bench step "${args[@]}") jb=$($b bench step "${args[@]}")
  ma=$(field ms_per_step_median <<<"$ja") mb=$(field ms_per_step_median <<<"$jb")
  r=$(awk -v x="$ma" -v y="$mb" 'BEGIN { printf "%.3f", y / x }')
  ratios+=("$r")
  printf 'pair %d: A %.1f ms  B %.1f ms  B/A %s\n' "$i" "$ma" "$mb" "$r"
done
med() { sort -n | awk '{ a[NR] = $1 } END { printf "%.3f", NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
echo "median B/A step time over $pairs pairs: $(printf '%s\n' "${ratios[@]}" | med) (args: ${args[*]})"
