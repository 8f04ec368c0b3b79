#!/usr/bin/env bash
# Packs a CUDA build's strata and test_kernels with the non-CUDA shared libraries they load
# (oneDNN, oneTBB, liburing, fmt, OpenMPI, ...) into one tarball for bench/gpu/check.sh's
# PREBUILT mode, so a lent GPU machine without those packages spends no device time building;
# with OpenMPI's launcher too (bench/gpu/pack_ompi.sh), so the 2-rank checks run there.
# The C/C++ runtime and CUDA's libraries are left out: they come from the GPU machine.
# Usage: bash bench/gpu/pack.sh [BUILD_DIR (default build)] [OUT_TARBALL (default .gpu/sg.tar.xz)]
set -euo pipefail
BUILD="${1:-build}"
TAR="${2:-.gpu/sg.tar.xz}"
for b in strata test_kernels; do [ -x "$BUILD/bin/$b" ] || { echo "pack.sh: no $BUILD/bin/$b: build first" >&2; exit 1; }; done
ldd "$BUILD/bin/strata" | grep -q libcudart || { echo "pack.sh: $BUILD was built without CUDA" >&2; exit 1; }
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/sg/bin" "$STAGE/sg/lib" "$(dirname "$TAR")"
cp "$BUILD/bin/strata" "$BUILD/bin/test_kernels" "$STAGE/sg/bin/"
[ -x "$BUILD/bin/test_comm" ] && cp "$BUILD/bin/test_comm" "$STAGE/sg/bin/"  # (the NCCL tests)
[ -x "$BUILD/bin/comm_mpi_test" ] && cp "$BUILD/bin/comm_mpi_test" "$STAGE/sg/bin/"  # (2 ranks on one GPU, where mpirun is)
ldd "$BUILD/bin/strata" "$BUILD/bin/test_kernels" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' | sort -u |
  while read -r name path; do
    case "$name" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libstdc++.so*|libgcc_s.so*|libcu*|libnccl*|libnv*) ;;
      *) cp -L "$path" "$STAGE/sg/lib/$name" ;;
    esac
  done
# OpenMPI's launcher and plugins, for the 2-rank checks where the GPU machine has no mpirun.
bash "$(dirname "${BASH_SOURCE[0]}")/pack_ompi.sh" "$STAGE"
tar cJf "$TAR" -C "$STAGE" sg
echo "$TAR: $(du -h "$TAR" | cut -f1) ($(ls "$STAGE/sg/lib" | tr '\n' ' '))"
