#!/usr/bin/env bash
# Checks that a built tree needs no Debian package beyond what scripts/common.sh installs: every
# system file the build used (headers from the compilers' dependency files, libraries from the
# link lines, files CMake found and package configs it read) must belong to a package in the
# Depends/Pre-Depends closure of STRATA_PACKAGES. A file that only a Recommends brings in (how
# OpenCL's headers reached oneDNN's CMake config) is exactly what a --no-install-recommends
# install on a fresh machine lacks, so it fails here, naming the file and its package.
# Usage: scripts/check_packages.sh BUILD_DIR     (exit 0: complete; 1: something is missing)
set -euo pipefail
STRATA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$STRATA_ROOT/scripts/common.sh"
BUILD_DIR="${1:?usage: check_packages.sh BUILD_DIR}"
command -v dpkg-query >/dev/null && command -v apt-cache >/dev/null ||
  { echo "check_packages: not a Debian system (no dpkg/apt-cache); skipped"; exit 0; }

# 1. The packages the install step guarantees: the list and everything it depends on.
closure=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
  --no-replaces --no-enhances "${STRATA_PACKAGES[@]}" 2>/dev/null |
  sed -n 's/^ *|\{0,1\}\(Pre\)\{0,1\}Depends: <\{0,1\}\([^>]*\)>\{0,1\}$/\2/p; s/^\([a-z0-9][^ ]*\)$/\1/p' |
  sed 's/:.*$//' | sort -u)

# 2. The system files the build used (CUDA under /usr/local is optional and not a package).
used=$(mktemp)
trap 'rm -f "$used"' EXIT
find "$BUILD_DIR" -name '*.o.d' -print0 | xargs -0 -r cat | tr ' \\' '\n\n' | grep -E '^/usr/' >>"$used" || true
find "$BUILD_DIR" -name link.txt -print0 | xargs -0 -r cat | tr ' ' '\n' | grep -E '^/usr/.*\.(so|a)(\.[0-9.]+)?$' >>"$used" || true
if [ -f "$BUILD_DIR/CMakeCache.txt" ]; then
  sed -n 's/^[A-Za-z0-9_]*:\(FILEPATH\|PATH\|STRING\|INTERNAL\)=\(\/usr\/[^;]*\)$/\2/p' "$BUILD_DIR/CMakeCache.txt" |
    while read -r p; do
      if [ -f "$p" ]; then echo "$p"; elif [[ -d $p && $p == *cmake* ]]; then ls -d "$p"/*.cmake 2>/dev/null || true; fi
    done >>"$used"
fi
sort -u "$used" | grep -v '^/usr/local/' | while read -r f; do [ -e "$f" ] && realpath -s "$f"; done | sort -u >"$used.real"
mv "$used.real" "$used"

# 3. Who owns each file; anything outside the closure is a missing install step.
missing=0
while IFS= read -r line; do
  pkgs=${line%%: /*}
  file=${line#*: }
  ok=0
  for p in ${pkgs//,/ }; do
    p=${p%%:*}
    grep -qx "$p" <<<"$closure" && { ok=1; break; }
  done
  if [ $ok -eq 0 ]; then
    echo "check_packages: $file comes from package '$pkgs', which scripts/common.sh does not install (add it to STRATA_PACKAGES)"
    missing=1
  fi
done < <(xargs -r -a "$used" dpkg-query -S 2>/dev/null | grep -v '^diversion by' || true)
n=$(wc -l <"$used")
[ $missing -eq 0 ] && echo "check_packages: the $n system files this build used all come from the install list's dependency closure"
exit $missing
