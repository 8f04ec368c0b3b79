#!/usr/bin/env bash
# Two runs over one checkpoint directory, interleaved at random: run A (seed 1) and run B
# (seed 2) are each started fresh or with --resume auto, at random moments, and sent SIGINT,
# SIGTERM, SIGKILL, SIGUSR1 or nothing. After each trial, every step-N directory must verify
# (`strata inspect`: every file matches its trainer.json), `latest` must name one of them, the
# directory holds one run's checkpoints only, and a checkpoint seen before any start may have
# vanished only if a run of the same run id wrote a newer one (rotation removes only its own
# run's). Any other outcome fails the script.
# Usage: scripts/share_trials.sh [trials=20] [strata binary=build/bin/strata]
set -uo pipefail
TRIALS="${1:-20}"
BIN="$(realpath "${2:-build/bin/strata}")"
source "$(dirname "${BASH_SOURCE[0]}")/trials_common.sh"
trials_setup 2
ck="$work/ck"
fail() { echo "trial $1: $2"; exit 1; }
# "step-N run_id" for every checkpoint in the directory.
listing() {
  for d in "$ck"/step-*; do
    [[ -d "$d" ]] || continue
    echo "$(basename "$d") $(grep -o '"run_id": *"[^"]*"' "$d/trainer.json" 2>/dev/null | grep -o '[0-9a-f]\{16\}')"
  done
}
set -m  # runs start as a terminal's jobs do (SIGINT not ignored)
refused=0 ran=0
for ((i = 1; i <= TRIALS; i++)); do
  rm -rf "$ck"
  declare -A pids=()
  : >"$work/seen"
  for op in 1 2 3 4; do
    listing >>"$work/seen"
    who=$((RANDOM % 2))  # 0: A, 1: B
    seed=$((who + 1))
    resume=""
    ((RANDOM % 2)) && resume="--resume auto"
    "$BIN" train --model "$work/tiny" --threads 1 --batch 2 --seq 16 --steps $((20 + RANDOM % 40)) --seed "$seed" \
      --checkpoint-dir "$ck" --checkpoint-every $((1 + RANDOM % 3)) --keep 2 $resume >"$work/out.$op" 2>"$work/err.$op" &
    pids[$op]=$!
    sleep "0.$((RANDOM % 4))$((RANDOM % 10))"
    victim=${pids[$((1 + RANDOM % op))]}
    # Only while it is still this script's child (a finished run's pid may have been reused).
    [[ "$(ps -o ppid= -p "$victim" 2>/dev/null | tr -d ' ')" == "$$" ]] || victim=0
    ((victim > 0)) && case $((RANDOM % 5)) in
      0) kill -INT "$victim" 2>/dev/null ;;
      1) kill -TERM "$victim" 2>/dev/null ;;
      2) kill -KILL "$victim" 2>/dev/null ;;
      3) kill -USR1 "$victim" 2>/dev/null ;;
      *) ;;
    esac
  done
  for op in "${!pids[@]}"; do wait "${pids[$op]}" 2>/dev/null; done
  for op in 1 2 3 4; do
    if grep -q "in use by another strata run\|holds checkpoints of another run" "$work/err.$op"; then
      refused=$((refused + 1))
    fi
    ran=$((ran + 1))
    # A run may fail only by a refusal, a signal, or a resume of a finished run.
    if [[ -s "$work/err.$op" ]] && grep -q "error:" "$work/err.$op" &&
       ! grep -q "in use by another strata run\|holds checkpoints of another run\|nothing left to train" "$work/err.$op"; then
      fail "$i" "run $op failed: $(grep error: "$work/err.$op")"
    fi
  done
  # Every checkpoint verifies; `latest` names one; a single run id owns the directory.
  ids=""
  for d in "$ck"/step-*; do
    [[ -d "$d" ]] || continue
    "$BIN" inspect "$d" >/dev/null 2>"$work/err" || fail "$i" "$d does not verify: $(cat "$work/err")"
    ids+="$(grep -o '"run_id": *"[^"]*"' "$d/trainer.json")"$'\n'
  done
  [[ $(printf '%s' "$ids" | sort -u | grep -c .) -le 1 ]] || fail "$i" "checkpoints of two runs in one directory: $ids"
  if [[ -e "$ck/latest" ]]; then [[ -d "$ck/$(cat "$ck/latest")" ]] || fail "$i" "latest names a missing checkpoint"; fi
  # A vanished checkpoint: some run of its run id printed a newer checkpoint (its own rotation).
  listing >"$work/now"
  sort -u "$work/seen" | while read -r name id; do
    [[ -n "$id" ]] || continue  # renamed away while being listed (its run's rotation)
    grep -q "^$name $id\$" "$work/now" && continue
    step=$((10#${name#step-}))
    newer=0
    for op in 1 2 3 4; do
      grep -q "run id $id)" "$work/out.$op" 2>/dev/null || continue
      for n in $(grep '^checkpoint \|^stopped by .*checkpoint ' "$work/out.$op" | grep -o 'step-[0-9]*' | sed 's/step-0*//'); do
        ((n > step)) && newer=1
      done
    done
    ((newer)) || { echo "trial $i: $name of run $id vanished though no run of that id wrote a newer one"; exit 1; }
  done || exit 1
  unset pids
done
echo "share trials: $TRIALS trials of 4 interleaved runs ($ran runs, $refused refused as another run's), every" \
     "checkpoint verified, never two runs' checkpoints in one directory"
