#!/usr/bin/env bash
# A/B comparison of `strata bench io` with fio (io_uring and libaio engines) on the same disk:
# runs alternate fio-uring, fio-libaio, strata on fio's file, strata through SwapSpace for each
# (mode, qd), in an order rotated every round, then prints the median MB/s and CPU s/GB of each.
# The disk's host-side cap swings run to run, hence medians.
# Usage: bench/io/compare_fio.sh [DIR]   env: SIZE=4G BS=1M QDS="8 32" MODES="read write" ROUNDS=4 SWAP=1
set -euo pipefail
DIR=${1:-/tmp/strata-fio-bench}
SIZE=${SIZE:-4G}
BS=${BS:-1M}
QDS=${QDS:-"8 32"}
MODES=${MODES:-"read write"}
ROUNDS=${ROUNDS:-4}
STRATA=${STRATA:-build/bin/strata}
REAP=${REAP:-caller}
command -v fio >/dev/null || { echo "compare_fio.sh: fio is not installed (apt-get install fio)" >&2; exit 1; }
[ -x "$STRATA" ] || { echo "compare_fio.sh: $STRATA not found; build first (scripts/test.sh) or set STRATA=" >&2; exit 1; }
mkdir -p "$DIR"
OUT=$(mktemp /tmp/compare_fio.XXXXXX.tsv)
trap 'rm -f "$DIR/fio.dat" "$DIR/fio-w.dat"; rmdir "$DIR" 2>/dev/null || true' EXIT
echo "# $(date -u) $(uname -r) nproc=$(nproc) size=$SIZE bs=$BS dir=$DIR free=$(df -h --output=avail "$DIR" | tail -1)" >&2

fio_run() {  # engine mode qd -> "mb_per_s cpu_s_per_gb"
  local eng=$1 mode=$2 qd=$3 file=$DIR/fio.dat
  if [ "$mode" = write ] || [ "$mode" = randwrite ]; then file=$DIR/fio-w.dat; fi
  fio --name=cmp --filename="$file" --ioengine="$eng" --direct=1 --rw="$mode" --bs="$BS" --iodepth="$qd" \
      --size="$SIZE" --numjobs=1 --output-format=json 2>/dev/null |
    python3 -c '
import json, sys
j = json.load(sys.stdin)["jobs"][0]
side = j["read"] if j["read"]["io_bytes"] > 0 else j["write"]
secs = side["runtime"] / 1000.0
gb = side["io_bytes"] / 1e9
cpu = (j["usr_cpu"] + j["sys_cpu"]) / 100.0 * secs
print("%.1f %.4f" % (side["bw_bytes"] / 1e6, cpu / gb))'
}

strata_run() {  # target mode qd -> "mb_per_s cpu_s_per_gb"
  # file: the very file fio uses (same blocks, laid out once, overwritten in place by writes).
  # swap: a fresh fallocated extent through SwapSpace (reads first fill it, untimed).
  local target=(--path "$DIR") file=$DIR/fio.dat
  if [ "$2" = write ] || [ "$2" = randwrite ]; then file=$DIR/fio-w.dat; fi
  if [ "$1" = file ]; then target=(--file "$file"); fi
  "$STRATA" bench io "${target[@]}" --size "$SIZE" --block "$BS" --qd "$3" --mode "$2" --engine uring --reap "$REAP" |
    python3 -c 'import json,sys; j=json.loads(sys.stdin.readline()); print("%.1f %.4f" % (j["mb_per_s"], j["cpu_s_per_gb"]))'
}

# Both fio files are laid out (written) once, before the first round: later writes overwrite in
# place, as writes to a preallocated swap file do (a fresh file would make every fio write extend it).
for f in fio.dat fio-w.dat; do
  fio --name=layout --filename="$DIR/$f" --rw=write --bs=4M --direct=1 --size="$SIZE" --ioengine=io_uring >/dev/null 2>&1
done

run_tool() {  # tool mode qd -> "mb_per_s cpu_s_per_gb"
  case $1 in
    fio-io_uring) fio_run io_uring "$2" "$3" ;;
    fio-libaio) fio_run libaio "$2" "$3" ;;
    strata-file) strata_run file "$2" "$3" ;;
    strata-swap) strata_run swap "$2" "$3" ;;
  esac
}

TOOLS=(fio-io_uring fio-libaio strata-file)
if [ "${SWAP:-1}" = 1 ]; then TOOLS+=(strata-swap); fi
# The host caches what was just read or written, so a run right after another on the same file
# can be faster: the order of the tools rotates every round (use ROUNDS = a multiple of the
# number of tools so each tool takes each position equally often).
for round in $(seq "$ROUNDS"); do
  for mode in $MODES; do
    for qd in $QDS; do
      load=$(cut -d' ' -f1 /proc/loadavg)
      n=${#TOOLS[@]}
      for i in $(seq 0 $((n - 1))); do
        tool=${TOOLS[$(((i + round) % n))]}
        echo -e "$mode\t$qd\t$tool\t$(run_tool "$tool" "$mode" "$qd")\t$load\t$i" | tee -a "$OUT" >&2
      done
    done
  done
done

python3 - "$OUT" <<'PY'
import sys, statistics, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    mode, qd, tool, rest = line.rstrip("\n").split("\t", 3)
    mb, cpu = rest.split("\t")[0].split()
    rows[(mode, int(qd), tool)].append((float(mb), float(cpu)))
print(f"{'mode':6} {'qd':>3} {'tool':13} {'median MB/s':>11} {'runs MB/s':30} {'cpu s/GB':>8} {'strata/fio':>10}")
for (mode, qd, tool), v in sorted(rows.items()):
    med = statistics.median(m for m, _ in v)
    cpu = statistics.median(c for _, c in v)
    ref = statistics.median(m for m, _ in rows[(mode, qd, "fio-io_uring")])
    runs = " ".join(f"{m:.0f}" for m, _ in v)
    print(f"{mode:6} {qd:3} {tool:13} {med:11.0f} {runs:30} {cpu:8.4f} {med / ref:10.2f}")
PY
echo "raw: $OUT" >&2
