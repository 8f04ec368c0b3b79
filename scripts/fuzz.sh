#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang + ASan + UBSan) in build-fuzz/ and runs each for a
# bounded time on a copy of its checked-in seed corpus (fuzz/corpus/NAME/, with fuzz/NAME.dict).
# Fails if any target finds a crash, a leak, a hang (-timeout) or a sanitizer report; the
# reproducer is left in build-fuzz/fuzz/fuzz_NAME-crash-* (rerun: build-fuzz/fuzz/fuzz_NAME FILE).
# Usage: scripts/fuzz.sh [seconds per target, default 60] [target...]
#   FUZZ_BUILD_DIR overrides build-fuzz/; FUZZ_JOBS runs that many workers per target.
set -euo pipefail
STRATA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_PER_TARGET="${1:-60}"
shift || true
BUILD="${FUZZ_BUILD_DIR:-$STRATA_ROOT/build-fuzz}"
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ not found (apt-get install clang)"; exit 1; }

CC=clang CXX=clang++ cmake -S "$STRATA_ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Fuzz -DSTRATA_FUZZ=ON \
  -DSTRATA_CUDA=OFF -DSTRATA_BUILD_TESTS=OFF -DSTRATA_BUILD_BENCH=OFF -DSTRATA_WERROR=ON >/dev/null
cmake --build "$BUILD" --target strata_fuzz -j "$(nproc)"

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for src in "$STRATA_ROOT"/fuzz/fuzz_*.cpp; do targets+=("$(basename "$src" .cpp)"); done
fi
status=0
for t in "${targets[@]}"; do
  name="${t#fuzz_}"
  work="$BUILD/fuzz/corpus-$name"  # the seeds plus what this machine's runs found
  mkdir -p "$work"
  cp -n "$STRATA_ROOT/fuzz/corpus/$name"/* "$work"/ 2>/dev/null || true
  dict=()
  [ -f "$STRATA_ROOT/fuzz/$name.dict" ] && dict=(-dict="$STRATA_ROOT/fuzz/$name.dict")
  echo "== fuzz_$name: ${SECONDS_PER_TARGET}s"
  if ! (cd "$BUILD/fuzz" && "./fuzz_$name" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 \
          -max_len=65536 -print_final_stats=1 "${dict[@]}" ${FUZZ_JOBS:+-jobs=$FUZZ_JOBS -workers=$FUZZ_JOBS} \
          -artifact_prefix="$BUILD/fuzz/fuzz_$name-" "$work" 2>"$BUILD/fuzz/fuzz_$name.log"); then
    echo "fuzz_$name FAILED: see $BUILD/fuzz/fuzz_$name.log"; tail -40 "$BUILD/fuzz/fuzz_$name.log"; status=1
  fi
  grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb" "$BUILD/fuzz/fuzz_$name.log" || true
done
exit $status
