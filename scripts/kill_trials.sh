#!/usr/bin/env bash
# kill -9 `strata train` at random moments while it writes a checkpoint after every step, then
# check what it left: every step-N directory verifies (`strata inspect`), `latest` names one of
# them, and `--resume auto` continues bit-exact (the remaining steps' losses and grad norms equal
# an uninterrupted run's). Any other outcome fails the script.
# Usage: scripts/kill_trials.sh [trials=100] [strata binary=build/bin/strata]
#        scripts/kill_trials.sh --mpi [trials=50] [binary]: 2-rank mpirun jobs, Ctrl-C on the
#        launcher or kill -9 of a rank (scripts/kill_trials_mpi.sh)
set -euo pipefail
if [[ "${1:-}" == "--mpi" ]]; then
  shift
  exec bash "$(dirname "${BASH_SOURCE[0]}")/kill_trials_mpi.sh" "$@"
fi
TRIALS="${1:-100}"
BIN="$(realpath "${2:-build/bin/strata}")"
source "$(dirname "${BASH_SOURCE[0]}")/trials_common.sh"
trials_setup 3
STEPS=12
ARGS=(train --model "$work/tiny" --threads 1 --batch 2 --seq 16 --warmup 2 --steps "$STEPS" --checkpoint-every 1 --keep 3)

t0=$(date +%s%N)
"$BIN" "${ARGS[@]}" --checkpoint-dir "$work/ref-ck" --metrics "$work/ref.jsonl" >/dev/null
dur_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
exact "$work/ref.jsonl" >"$work/ref.txt"
echo "reference run: $STEPS steps, a checkpoint after each, ${dur_ms} ms"

mid_write=0 resumed=0 none=0
for ((i = 1; i <= TRIALS; i++)); do
  ck="$work/ck"
  rm -rf "$ck"
  "$BIN" "${ARGS[@]}" --checkpoint-dir "$ck" >/dev/null 2>&1 &
  pid=$!
  sleep "$(awk -v r="$RANDOM" -v d="$dur_ms" 'BEGIN { printf "%.3f", (r / 32768) * d / 1000 }')"
  kill -9 "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  if compgen -G "$ck/.tmp-*" >/dev/null; then mid_write=$((mid_write + 1)); fi
  for d in "$ck"/step-*; do
    [[ -d "$d" ]] || continue
    "$BIN" inspect "$d" >/dev/null 2>"$work/err" || { echo "trial $i: $d is not complete: $(cat "$work/err")"; exit 1; }
  done
  if [[ ! -e "$ck/latest" ]]; then none=$((none + 1)); continue; fi
  latest="$ck/$(cat "$ck/latest")"
  [[ -d "$latest" ]] || { echo "trial $i: latest names $latest, which does not exist"; exit 1; }
  step=$((10#${latest##*step-}))
  if ((step < STEPS)); then
    rm -f "$work/r.jsonl"
    "$BIN" "${ARGS[@]}" --checkpoint-dir "$ck" --resume auto --metrics "$work/r.jsonl" >/dev/null 2>"$work/err" ||
      { echo "trial $i: resume from $latest failed: $(cat "$work/err")"; exit 1; }
    exact "$work/r.jsonl" >"$work/r.txt"
    tail -n +"$((step + 1))" "$work/ref.txt" | cmp -s - "$work/r.txt" ||
      { echo "trial $i: resume from step $step is not bit-exact"; diff <(tail -n +"$((step + 1))" "$work/ref.txt") "$work/r.txt" | head; exit 1; }
    resumed=$((resumed + 1))
  fi
done
echo "kill -9 trials: $TRIALS, killed mid-write (a .tmp- directory left): $mid_write, resumed bit-exact: $resumed," \
     "killed before the first checkpoint: $none; every step-N verified, no failure"
