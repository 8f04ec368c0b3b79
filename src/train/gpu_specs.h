// GPUs that `strata plan --backend cuda` can model where none is present (`--gpu NAME`), so a
// user can size a machine before renting it: vendor datasheet figures (dense tensor rates, not
// the 2:4-sparse ones the datasheets print first), and the efficiency the plan applies to them.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace strata {

struct GpuSpec {
  std::string name;          // --gpu NAME ("custom": from --gpu-tflops, --gpu-mem, --pcie-gbs)
  std::string description;   // the product as its datasheet names it
  double bf16_tflops = 0;    // dense tensor-core peak, bf16 (and fp16) in, fp32 accumulate
  double fp32_tflops = 0;    // fp32 without tensor cores: strata's fp32 GEMMs run CUBLAS_COMPUTE_32F
  double mem_gib = 0;        // device memory (HBM "GB" are GiB: the H200 reported 143771 MiB)
  double pcie_gbs = 0;       // host link, GB/s each way
  double hbm_gbs = 0;        // device memory bandwidth, GB/s; 0: not known (custom without --gpu-hbm-gbs)
  uint64_t mem_bytes() const { return static_cast<uint64_t>(mem_gib * static_cast<double>(uint64_t{1} << 30)); }
};

// h100, h200, a100-80g, rtx4090, l40s.
std::span<const GpuSpec> known_gpus();
// The known GPU of that name, or null.
const GpuSpec* find_gpu(std::string_view name);
// The known GPU a CUDA device's name ("NVIDIA H200", "NVIDIA GeForce RTX 4090", ...) is, or null:
// its peak for the per-phase efficiency `strata plan` reports on a real GPU.
const GpuSpec* match_gpu(std::string_view device_name);
// "h100|h200|a100-80g|rtx4090|l40s", for messages and --help.
std::string known_gpu_names();

// The fraction of the dense peak a modeled GPU is taken to reach over a whole step: the MFU
// measured on the first GPU strata ran on (an H200, llama-1b bf16, B=8 T=2048, resident:
// 291-294 ms a step, 37.2-37.6% of 989 TFLOP/s counting 6·N·tokens; bench/RESULTS.md, "First
// runs on a GPU"). A guess for other GPUs and shapes (short rows reach less), stated as such.
constexpr double kModeledMfu = 0.376;
// The fraction of HBM bandwidth a memory-bound kernel is taken to reach: AdamW over 100M
// parameters on that H200 moved 3.79 of its 4.8 TB/s (same section).
constexpr double kModeledHbmEfficiency = 0.79;

}  // namespace strata
