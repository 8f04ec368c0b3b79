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
source "$(dirname "$0")/ab_lib.sh"
pair() {
  local ja jb
  ja=$($a bench step "${args[@]}") jb=$($b bench step "${args[@]}")
  MA=$(field ms_per_step_median <<<"$ja") MB=$(field ms_per_step_median <<<"$jb")
}
ab_pairs "$pairs" pair
echo "median B/A step time over $pairs pairs: $AB_MEDIAN (args: ${args[*]})"
