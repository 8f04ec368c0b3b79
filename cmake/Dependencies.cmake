# All third-party dependencies, from Debian packages (scripts/test.sh installs them).
# Nothing is vendored or downloaded.
find_package(Threads REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(URING REQUIRED IMPORTED_TARGET liburing)
find_package(TBB REQUIRED)
find_package(dnnl REQUIRED)
find_package(OpenMP REQUIRED)
find_package(fmt REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(CLI11 REQUIRED)
# text/ (tokenizers, chat templates, `strata data`): PCRE2 with JIT for the pre-tokenizers'
# Unicode regexes, ICU for NFC/NFKC, zlib for .gz inputs and the test fixtures.
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
find_package(ICU REQUIRED COMPONENTS uc)
find_package(ZLIB REQUIRED)
# MPI is optional: with it strata_core gains the mpi communicator (src/comm/mpi.cpp, C API only)
# and CTest the multi-rank tests; without it only the local communicator exists. Build without
# it on a machine that has it with -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON.
find_package(MPI COMPONENTS C)
if(STRATA_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(STRATA_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()

set(STRATA_HAVE_CUDA OFF)
if(NOT STRATA_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # Ampere (A100, A10/3090), Ada (L4/L40/4090) and Hopper (H100/H200); the kernels need sm_80+
      # (bf16 tensor cores). CI and bench/gpu/check.sh build one: -DCMAKE_CUDA_ARCHITECTURES=90.
      set(CMAKE_CUDA_ARCHITECTURES "80;86;89;90")
    endif()
    enable_language(CUDA)
    # CUDA code is C++20 like the rest (CUDA_STANDARD follows CXX_STANDARD); CMake 3.25 does not
    # know nvcc 12+'s flag for it.
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    find_package(CUDAToolkit REQUIRED)
    find_library(STRATA_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    find_path(STRATA_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    set(STRATA_HAVE_CUDA ON)
  elseif(STRATA_CUDA STREQUAL "ON")
    message(FATAL_ERROR "STRATA_CUDA=ON but no CUDA compiler was found; install the CUDA toolkit or use -DSTRATA_CUDA=OFF")
  endif()
endif()
