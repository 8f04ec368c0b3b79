#!/usr/bin/env bash
# Paired precision comparison of `strata bench step` on a noisy (shared) machine: runs the fp32
# and the bf16 step benchmark alternately, PAIRS times, and prints each pair's median ms/step
# and their ratio (and the same from each run's fastest step, which noise can only slow), then
# the median ratios over pairs. Extra arguments go to both runs.
#   bench/step_ratio.sh [PAIRS] [-- extra bench-step flags]
# Default config: GPT-2 124M, B=4, T=64 (issue 3's figure).
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=5
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then pairs=$1; shift; fi
if [[ "${1:-}" == "--" ]]; then shift; fi
bin=build/bin/strata
[[ -x $bin ]] || { echo "step_ratio.sh: $bin not found; build first (scripts/test.sh or cmake --build build)" >&2; exit 1; }
args=(--preset gpt2-124m --batch 4 --seq 64 --warmup 2 --steps 7 "$@")
field() { sed -E "s/.*\"$1\":([0-9.eE+-]+).*/\1/"; }
ratios=() min_ratios=()
for ((i = 1; i <= pairs; i++)); do
  jf=$($bin bench step "${args[@]}" --dtype fp32)
  jb=$($bin bench step "${args[@]}" --dtype bf16)
  f=$(field ms_per_step_median <<<"$jf") b=$(field ms_per_step_median <<<"$jb")
  fm=$(field ms_per_step_min <<<"$jf") bm=$(field ms_per_step_min <<<"$jb")
  r=$(awk -v f="$f" -v b="$b" 'BEGIN { printf "%.3f", f / b }')
  rm=$(awk -v f="$fm" -v b="$bm" 'BEGIN { printf "%.3f", f / b }')
  ratios+=("$r") min_ratios+=("$rm")
  printf 'pair %d: median fp32 %.1f ms  bf16 %.1f ms  ratio %s | fastest step fp32 %.1f  bf16 %.1f  ratio %s\n' \
    "$i" "$f" "$b" "$r" "$fm" "$bm" "$rm"
done
med() { sort -n | awk '{ a[NR] = $1 } END { printf "%.3f", NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
echo "median bf16/fp32 speed-up over $pairs pairs: $(printf '%s\n' "${ratios[@]}" | med) (median steps)," \
  "$(printf '%s\n' "${min_ratios[@]}" | med) (fastest steps)"
