// The table behind `strata plan --gpu NAME`. Each row's figures and where they come from.
#include "src/train/gpu_specs.h"

#include <array>
#include <cctype>
#include <utility>

namespace strata {
namespace {

const std::array<GpuSpec, 5> kGpus{{
    // NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: BF16 Tensor Core 1,979 TFLOPS with
    // sparsity (989 dense), FP32 67 TFLOPS, 80 GB HBM3 at 3.35 TB/s, PCIe Gen5 128 GB/s (64 each way).
    {"h100", "NVIDIA H100 SXM5 80GB", 989, 67, 80, 64, 3350},
    // NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: BF16 1,979 TFLOPS with sparsity
    // (989 dense), FP32 67 TFLOPS, 141 GB HBM3e at 4.8 TB/s, PCIe Gen5 128 GB/s (64 each way).
    {"h200", "NVIDIA H200 SXM 141GB", 989, 67, 141, 64, 4800},
    // NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column: BF16 Tensor Core 312 TFLOPS
    // (624 with sparsity), FP32 19.5 TFLOPS, 80 GB HBM2e at 2,039 GB/s, PCIe Gen4 64 GB/s (32 each way).
    {"a100-80g", "NVIDIA A100 80GB SXM4", 312, 19.5, 80, 32, 2039},
    // NVIDIA Ada GPU architecture whitepaper, appendix A (GeForce RTX 4090): peak BF16 Tensor
    // TFLOPS with FP32 accumulate 165.2 (330.4 with sparsity), FP32 82.6 TFLOPS, 24 GB GDDR6X at
    // 1,008 GB/s; PCI Express 4.0 x16 (31.5 GB/s each way).
    {"rtx4090", "NVIDIA GeForce RTX 4090 24GB", 165.2, 82.6, 24, 31.5, 1008},
    // NVIDIA L40S datasheet: BF16 Tensor Core 362.05 TFLOPS (733 with sparsity), FP32 91.6
    // TFLOPS, 48 GB GDDR6 at 864 GB/s, PCIe Gen4 x16 64 GB/s bidirectional (32 each way).
    {"l40s", "NVIDIA L40S 48GB", 362.05, 91.6, 48, 32, 864},
}};

}  // namespace

std::span<const GpuSpec> known_gpus() { return kGpus; }

const GpuSpec* find_gpu(std::string_view name) {
  for (const GpuSpec& g : kGpus)
    if (g.name == name) return &g;
  return nullptr;
}

const GpuSpec* match_gpu(std::string_view device_name) {
  std::string n;
  for (char c : device_name)
    if (std::isalnum(static_cast<unsigned char>(c))) n += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  // The model number as the driver names it (an A100 of 40 GB has the 80 GB one's peak).
  constexpr std::pair<std::string_view, std::string_view> tokens[] = {
      {"h200", "h200"}, {"h100", "h100"}, {"a100", "a100-80g"}, {"rtx4090", "rtx4090"}, {"l40s", "l40s"}};
  for (const auto& [token, name] : tokens)
    if (n.find(token) != std::string::npos) return find_gpu(name);
  return nullptr;
}

std::string known_gpu_names() {
  std::string s;
  for (const GpuSpec& g : kGpus) s += (s.empty() ? "" : "|") + g.name;
  return s;
}

}  // namespace strata
