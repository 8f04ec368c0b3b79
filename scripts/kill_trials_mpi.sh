#!/usr/bin/env bash
# kill_trials.sh for 2-rank mpirun jobs (started by scripts/strata-mpirun, ZeRO stage 1, a
# checkpoint after every step): each trial stops the job at a random moment, either as a user's
# Ctrl-C (SIGINT to the launcher's process group) or by kill -9 of one rank (a crashed node),
# then checks what it left: every step-N directory verifies (`strata inspect`), `latest` names
# one of them, no temporary directory survives the next run, and a 2-rank `--resume auto`
# continues bit-exact (the remaining steps' losses and grad norms equal an uninterrupted run's).
# Any other outcome fails the script.
# Usage: scripts/kill_trials_mpi.sh [trials=50] [strata binary=build/bin/strata]
set -euo pipefail
TRIALS="${1:-50}"
BIN="$(realpath "${2:-build/bin/strata}")"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
command -v mpirun >/dev/null || { echo "kill_trials_mpi: no mpirun: skipped"; exit 0; }
source "$(dirname "${BASH_SOURCE[0]}")/trials_common.sh"
trials_setup 3
STEPS=12
ARGS=(train --model "$work/tiny" --threads 1 --batch 2 --seq 16 --warmup 2 --steps "$STEPS" --zero-stage 1
      --checkpoint-every 1 --keep 3)
launch() { bash "$ROOT/scripts/strata-mpirun" -np 2 "$BIN" "$@"; }
descendants() { local c; for c in $(pgrep -P "$1"); do echo "$c"; descendants "$c"; done; }

t0=$(date +%s%N)
launch "${ARGS[@]}" --checkpoint-dir "$work/ref-ck" --metrics "$work/ref.jsonl" >/dev/null 2>&1
dur_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
exact "$work/ref.jsonl" >"$work/ref.txt"
echo "reference 2-rank run: $STEPS steps, a checkpoint after each, ${dur_ms} ms"

set -m  # each launcher in a process group of its own, as a shell job in a terminal
ctrl_c=0 killed=0 resumed=0 none=0
for ((i = 1; i <= TRIALS; i++)); do
  ck="$work/ck"
  rm -rf "$ck"
  launch "${ARGS[@]}" --checkpoint-dir "$ck" >"$work/log" 2>&1 &
  pid=$!
  sleep "$(awk -v r="$RANDOM" -v d="$dur_ms" 'BEGIN { printf "%.3f", (r / 32768) * d / 1000 }')"
  if ((RANDOM % 2)); then
    kill -INT -- "-$pid" 2>/dev/null || true
    ctrl_c=$((ctrl_c + 1))
  else
    # One of this job's ranks: a strata process among the job's descendants (never another
    # test's process, never mpirun itself).
    rank=$(for p in $(descendants "$pid"); do
             [[ "$(ps -o args= -p "$p" 2>/dev/null)" == "$BIN train"* ]] && echo "$p"
           done | shuf -n 1 || true)
    [[ -n "$rank" ]] && kill -9 "$rank" 2>/dev/null || true
    killed=$((killed + 1))
  fi
  wait "$pid" 2>/dev/null || true
  # A rank killed mid-write leaves a .tmp-<pid>-* directory: removed by the next run, never used.
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
    launch "${ARGS[@]}" --checkpoint-dir "$ck" --resume auto --metrics "$work/r.jsonl" >/dev/null 2>"$work/err" ||
      { echo "trial $i: resume from $latest failed: $(tail -5 "$work/err")"; exit 1; }
    if compgen -G "$ck/.tmp-*" >/dev/null; then echo "trial $i: a temporary directory survived the resume"; exit 1; fi
    exact "$work/r.jsonl" >"$work/r.txt"
    tail -n +"$((step + 1))" "$work/ref.txt" | cmp -s - "$work/r.txt" ||
      { echo "trial $i: resume from step $step is not bit-exact"; diff <(tail -n +"$((step + 1))" "$work/ref.txt") "$work/r.txt" | head; exit 1; }
    resumed=$((resumed + 1))
  fi
done
echo "mpirun trials: $TRIALS (Ctrl-C $ctrl_c, kill -9 of a rank $killed), resumed bit-exact: $resumed," \
     "stopped before the first checkpoint: $none; every step-N verified, 0 corrupt checkpoints"
