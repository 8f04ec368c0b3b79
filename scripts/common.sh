# Shared by scripts/test.sh and scripts/demo.sh: install what is missing, configure, build.
# Debian 12 packages only; idempotent and quick when everything is already there.
STRATA_PACKAGES=(
  g++ cmake make pkg-config git
  # scripts/kill_trials_mpi.sh finds a job's ranks with pgrep
  procps
  liburing-dev libtbb-dev libdnnl-dev libopenmpi-dev openmpi-bin
  # oneDNN's CMake config calls find_package(OpenCL REQUIRED); libdnnl-dev only Recommends these.
  ocl-icd-opencl-dev opencl-c-headers
  libcli11-dev nlohmann-json3-dev libfmt-dev
  # text/: pre-tokenizer regexes (PCRE2), NFC/NFKC (ICU), .gz inputs (zlib)
  libpcre2-dev libicu-dev zlib1g-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  # scripts/fuzz.sh (CI's short fuzz run): clang and its libFuzzer/sanitizer runtimes, which
  # clang-14 only Recommends.
  clang libclang-rt-14-dev
)

strata_install_deps() {
  local missing=()
  for p in "${STRATA_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "strata: installing missing packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# strata_build BUILD_DIR [cmake args...]
strata_build() {
  local dir="$1"; shift
  cmake -S "$STRATA_ROOT" -B "$dir" -DCMAKE_BUILD_TYPE=Release "$@"
  cmake --build "$dir" -j "$(nproc)"
}
