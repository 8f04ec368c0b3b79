#!/usr/bin/env bash
# Stages this machine's OpenMPI launcher into STAGE/sg (for bench/gpu/pack.sh), so that
# bench/gpu/check.sh's 2-rank checks run on a GPU machine that has no mpirun: orterun and orted
# under STAGE/sg/ompi laid out as OpenMPI's prefix (OPAL_PREFIX relocates it), OpenMPI's and
# PMIx's MCA plugins and help texts, and every shared library they load into STAGE/sg/lib (the
# C/C++ runtime excepted, as pack.sh does). STAGE/sg/ompi/env.sh sets the variables that point
# OpenMPI and PMIx there; check.sh sources it where the machine has no mpirun of its own.
# Usage: bash bench/gpu/pack_ompi.sh STAGE   (a no-op, saying so, where OpenMPI is not installed)
set -euo pipefail
STAGE="$1"
command -v orterun > /dev/null && command -v ompi_info > /dev/null ||
  { echo "pack_ompi.sh: no OpenMPI launcher here (orterun, ompi_info): the 2-rank checks will need the GPU machine's"; exit 0; }
path() { ompi_info --path "$1" --parsable | cut -d: -f3; }
PREFIX=$(path prefix)
PKGLIB=$(path pkglibdir)
PKGDATA=$(path pkgdatadir)
case "$PKGLIB$PKGDATA" in "$PREFIX"/*"$PREFIX"/*) ;; *) echo "pack_ompi.sh: OpenMPI's dirs are not under its prefix $PREFIX" >&2; exit 1 ;; esac
O="$STAGE/sg/ompi"
mkdir -p "$O/bin" "$O${PKGLIB#"$PREFIX"}" "$O${PKGDATA#"$PREFIX"}" "$STAGE/sg/lib"
cp -L "$(command -v orterun)" "$O/bin/orterun"
ln -sf orterun "$O/bin/mpirun"
command -v orted > /dev/null && cp -L "$(command -v orted)" "$O/bin/orted"
cp -L "$PKGLIB"/*.so "$O${PKGLIB#"$PREFIX"}/"
cp -rL "$PKGDATA"/. "$O${PKGDATA#"$PREFIX"}/"
# PMIx (OpenMPI 4 on Debian uses the system's): its plugins, found through PMIX_INSTALL_PREFIX.
PMIX_LIB=$(ldconfig -p | awk '/libpmix\.so\.2 / { print $NF; exit }')
PMIX_PREFIX=""
for d in $(dirname "${PMIX_LIB:-/nonexistent}")/pmix2 /usr/lib/x86_64-linux-gnu/pmix2 /usr/lib64/pmix /usr/lib/pmix; do
  [ -d "$d/lib/pmix" ] && { PMIX_PREFIX="$d"; break; }
done
if [ -n "$PMIX_PREFIX" ]; then
  mkdir -p "$STAGE/sg/pmix/lib/pmix" "$STAGE/sg/pmix/share"
  cp -L "$PMIX_PREFIX"/lib/pmix/*.so "$STAGE/sg/pmix/lib/pmix/"
  [ -d "$PMIX_PREFIX/share/pmix" ] && cp -rL "$PMIX_PREFIX/share/pmix" "$STAGE/sg/pmix/share/"
fi
# Every library the launcher and the plugins load, less the C/C++ runtime and CUDA's.
{ ldd "$O/bin/orterun"; [ -x "$O/bin/orted" ] && ldd "$O/bin/orted"
  for f in "$O${PKGLIB#"$PREFIX"}"/*.so "$STAGE"/sg/pmix/lib/pmix/*.so; do [ -e "$f" ] && ldd "$f"; done; } 2> /dev/null |
  awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' | sort -u |
  while read -r name lib; do
    case "$name" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libstdc++.so*|libgcc_s.so*|libcu*|libnccl*|libnv*) ;;
      *) [ -e "$STAGE/sg/lib/$name" ] || cp -L "$lib" "$STAGE/sg/lib/$name" ;;
    esac
  done
cat > "$O/env.sh" << 'EOF'
# Sourced by bench/gpu/check.sh where the machine has no mpirun: this tarball's OpenMPI.
SG_OMPI="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export OPAL_PREFIX="$SG_OMPI"
export PMIX_INSTALL_PREFIX="$(dirname "$SG_OMPI")/pmix"
export PMIX_MCA_mca_base_component_path="$PMIX_INSTALL_PREFIX/lib/pmix"
export PATH="$SG_OMPI/bin:$PATH"
export LD_LIBRARY_PATH="$(dirname "$SG_OMPI")/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# No /etc/openmpi here: loopback TCP and shared memory only, no InfiniBand probes.
export OMPI_MCA_btl="${OMPI_MCA_btl:-self,vader,tcp}" OMPI_MCA_pml="${OMPI_MCA_pml:-ob1}"
export OMPI_MCA_mtl="${OMPI_MCA_mtl:-^ofi,psm,psm2}" OMPI_MCA_btl_tcp_if_include="${OMPI_MCA_btl_tcp_if_include:-lo}"
export OMPI_MCA_oob_tcp_if_include="${OMPI_MCA_oob_tcp_if_include:-lo}"
# (one machine: no ssh needed to start the ranks)
export OMPI_MCA_plm="${OMPI_MCA_plm:-isolated}"
EOF
echo "pack_ompi.sh: staged OpenMPI $(ompi_info --version 2> /dev/null | awk 'NR == 1 { print $NF }') ($(ls "$O${PKGLIB#"$PREFIX"}" | wc -l) plugins)"
