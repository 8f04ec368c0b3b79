#!/usr/bin/env bash
# Installs what is missing, builds strata (warnings as errors) and runs every test with CTest.
# Usage: scripts/test.sh [ctest args...]   (BUILD_DIR overrides the build folder, default build/)
set -euo pipefail
STRATA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$STRATA_ROOT/scripts/common.sh"
BUILD_DIR="${BUILD_DIR:-$STRATA_ROOT/build}"

strata_install_deps
# One CUDA architecture (sm_90) keeps CI's compile time modest; the default builds 80;86;89;90.
strata_build "$BUILD_DIR" -DSTRATA_WERROR=ON -DSTRATA_BUILD_TESTS=ON -DSTRATA_BUILD_BENCH=ON -DCMAKE_CUDA_ARCHITECTURES=90
# Every system file the build used must come from the install list (what a fresh machine gets).
bash "$STRATA_ROOT/scripts/check_packages.sh" "$BUILD_DIR"
(cd "$BUILD_DIR" && ctest --output-on-failure -j "$(nproc)" "$@")
# A short libFuzzer pass over the parsers' seed corpora (regression inputs included): about a
# minute on 2 cores with the build, STRATA_FUZZ_SECONDS per target (default 3; 0 skips it).
if [ "${STRATA_FUZZ_SECONDS:-3}" != 0 ]; then
  bash "$STRATA_ROOT/scripts/fuzz.sh" "${STRATA_FUZZ_SECONDS:-3}"
fi
