// The safetensors container (8-byte little-endian header length N, N bytes of JSON
// {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the data) — a hardened
// header parser and the header writer. Internal to src/checkpoint.
#pragma once
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/dtype.h"

namespace strata::safetensors {

// Headers above this are rejected as corrupt (safetensors' own limit).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct Entry {
  std::string name;
  kernels::DType dtype = kernels::DType::f32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // relative to the start of the data area
};

struct Parsed {
  std::vector<Entry> entries;  // in file (offset) order
  uint64_t data_start = 0;     // 8 + N
};

// Validates and parses the file `bytes` (the whole mapped file, `size` bytes). `file` names it
// in errors. Every inconsistency throws std::runtime_error naming the file and the tensor.
Parsed parse(const void* bytes, uint64_t size, const std::string& file);

// Deepest nesting of [ and { outside strings. Checked before parsing untrusted JSON so a hostile
// file cannot exhaust the stack in recursive JSON code (a safetensors header needs depth 3).
int json_nesting_depth(std::string_view text);

// A small JSON file (config.json, the shard index) read, depth-checked (at most 64) and parsed;
// throws std::runtime_error naming the file when it cannot be read, nests too deeply or is not
// valid JSON.
nlohmann::json read_json_file(const std::filesystem::path& path);

// "F32", "BF16", "F16".
std::string_view dtype_tag(kernels::DType t);

// The 8-byte length prefix plus header JSON, padded with spaces so the data starts 8-byte
// aligned. Entries are written in the given order with their offsets; metadata {"format":"pt"}.
std::string build_header(const std::vector<Entry>& entries);

}  // namespace strata::safetensors
