#!/usr/bin/env bash
# Installs what is missing, builds strata and runs its main job.
set -euo pipefail
STRATA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$STRATA_ROOT/scripts/common.sh"
BUILD_DIR="${BUILD_DIR:-$STRATA_ROOT/build}"

strata_install_deps
strata_build "$BUILD_DIR" -DSTRATA_BUILD_TESTS=OFF -DSTRATA_BUILD_BENCH=OFF
"$BUILD_DIR/bin/strata" bench ops
