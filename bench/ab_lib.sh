# Shared by bench/ab_step.sh and bench/ab_train.sh (sourced): runs PAIRS pairs through FN, which
# sets MA and MB (A's and B's ms per step) for pair $1; prints each pair's B/A and sets
# AB_MEDIAN to the median ratio (a shared machine swings by ±15%, so ratios are per pair).
ab_pairs() {
  local pairs=$1 fn=$2 ratios=() r i
  for ((i = 1; i <= pairs; i++)); do
    "$fn" "$i"
    r=$(awk -v x="$MA" -v y="$MB" 'BEGIN { printf "%.3f", y / x }')
    ratios+=("$r")
    printf 'pair %d: A %.1f ms  B %.1f ms  B/A %s\n' "$i" "$MA" "$MB" "$r"
  done
  AB_MEDIAN=$(printf '%s\n' "${ratios[@]}" | sort -n |
              awk '{ a[NR] = $1 } END { printf "%.3f", NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }')
}
