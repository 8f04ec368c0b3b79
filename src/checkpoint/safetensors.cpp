// Safetensors header parsing (hardened: a corrupt or hostile file produces an error naming
// the file and tensor, never an out-of-bounds read) and header writing in the layout HF's
// `safetensors` library produces (metadata first, data 8-byte aligned, space padding).
#include "src/checkpoint/safetensors.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "src/checkpoint/file_util.h"

namespace strata::safetensors {

namespace {

using nlohmann::json;

[[noreturn]] void fail(const std::string& file, const std::string& why) {
  throw std::runtime_error(file + ": " + why);
}
[[noreturn]] void fail_tensor(const std::string& file, const std::string& name, const std::string& why) {
  throw std::runtime_error(file + ": tensor '" + name + "': " + why);
}

// A JSON value for an error message, cut to a readable length.
std::string brief(const json& v) {
  std::string s = v.dump();
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

bool parse_dtype_tag(const std::string& tag, kernels::DType* out) {
  if (tag == "F32") *out = kernels::DType::f32;
  else if (tag == "BF16") *out = kernels::DType::bf16;
  else if (tag == "F16") *out = kernels::DType::f16;
  else return false;
  return true;
}

// A non-negative JSON integer, else throws naming `what`.
uint64_t non_negative_int(const json& v, const std::string& file, const std::string& name, const char* what) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  fail_tensor(file, name, std::string(what) + " must be non-negative integers, got " + brief(v));
}

Entry parse_entry(const std::string& name, const json& v, uint64_t data_size, const std::string& file) {
  if (!v.is_object()) fail_tensor(file, name, "expected an object {dtype, shape, data_offsets}, got " + brief(v));
  Entry e;
  e.name = name;
  if (!v.contains("dtype") || !v.at("dtype").is_string()) fail_tensor(file, name, "missing or non-string 'dtype'");
  const std::string tag = v.at("dtype").get<std::string>();
  if (!parse_dtype_tag(tag, &e.dtype))
    fail_tensor(file, name, "dtype " + tag + " is not supported (strata reads F32, BF16, F16)");

  if (!v.contains("shape") || !v.at("shape").is_array()) fail_tensor(file, name, "missing or non-array 'shape'");
  uint64_t numel = 1;
  bool overflow = false;
  for (const json& d : v.at("shape")) {
    uint64_t n = non_negative_int(d, file, name, "shape dimensions");
    if (n > static_cast<uint64_t>(INT64_MAX)) overflow = true;
    e.shape.push_back(static_cast<int64_t>(n));
    if (__builtin_mul_overflow(numel, n, &numel)) overflow = true;
  }
  uint64_t nbytes = 0;
  if (overflow || __builtin_mul_overflow(numel, kernels::dtype_size(e.dtype), &nbytes))
    fail_tensor(file, name, "shape " + brief(v.at("shape")) + " overflows 64-bit size");

  if (!v.contains("data_offsets") || !v.at("data_offsets").is_array() || v.at("data_offsets").size() != 2)
    fail_tensor(file, name, "'data_offsets' must be [begin, end]");
  e.begin = non_negative_int(v.at("data_offsets")[0], file, name, "data_offsets");
  e.end = non_negative_int(v.at("data_offsets")[1], file, name, "data_offsets");
  if (e.begin > e.end)
    fail_tensor(file, name, "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                                "] has begin after end");
  if (e.end > data_size)
    fail_tensor(file, name, "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                                "] run past the end of the data area (" + std::to_string(data_size) +
                                " bytes); file truncated?");
  if (e.end - e.begin != nbytes)
    fail_tensor(file, name, "shape " + brief(v.at("shape")) + " × " + tag + " is " + std::to_string(nbytes) +
                                " bytes but data_offsets span " + std::to_string(e.end - e.begin));
  return e;
}

}  // namespace

nlohmann::json read_json_file(const std::filesystem::path& path) {
  const std::string file = path.string();
  const std::string text = read_text_file(path);
  if (json_nesting_depth(text) > 64) throw std::runtime_error(file + ": JSON nests too deeply");
  // A key given twice in one object: JSON leaves it undefined, and nlohmann keeps the last one
  // silently; a config.json edited by hand with two "num_hidden_layers" is refused instead.
  std::vector<std::set<std::string>> keys;  // one set per object being parsed
  std::string duplicate;
  const auto check = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) keys.emplace_back();
    else if (event == E::object_end && !keys.empty()) keys.pop_back();
    else if (event == E::key && !keys.empty() && !keys.back().insert(parsed.get<std::string>()).second &&
             duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text, check);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(file + ": not valid JSON: " + e.what());
  }
  if (!duplicate.empty())
    throw std::runtime_error(file + ": the key \"" + duplicate + "\" is given twice; keep one");
  return j;
}

int json_nesting_depth(std::string_view text) {
  const char* p = text.data();
  const uint64_t n = text.size();
  int depth = 0, max_depth = 0;
  bool in_string = false;
  for (uint64_t i = 0; i < n; ++i) {
    const char c = p[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      max_depth = std::max(max_depth, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return max_depth;
}

std::string_view dtype_tag(kernels::DType t) {
  switch (t) {
    case kernels::DType::f32: return "F32";
    case kernels::DType::bf16: return "BF16";
    case kernels::DType::f16: return "F16";
  }
  return "?";
}

Parsed parse(const void* bytes, uint64_t size, const std::string& file) {
  if (size < 8)
    fail(file, "file is " + std::to_string(size) + " bytes, too small for the 8-byte safetensors header length");
  const auto* p = static_cast<const unsigned char*>(bytes);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | p[i];  // little-endian
  if (n > kMaxHeaderBytes)
    fail(file, "header length " + std::to_string(n) + " exceeds the " + std::to_string(kMaxHeaderBytes) +
                   "-byte limit (corrupt file?)");
  if (n > size - 8)
    fail(file, "header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(size) +
                   " bytes); file truncated?");
  const char* text = reinterpret_cast<const char*>(p + 8);
  if (n == 0 || text[0] != '{') fail(file, "header is not a JSON object");
  if (json_nesting_depth(std::string_view(text, n)) > 8)
    fail(file, "header JSON nests deeper than 8 levels (corrupt file?)");

  // Duplicate top-level keys would silently collapse in the JSON object: catch them while parsing.
  std::string duplicate;
  std::set<std::string> seen;
  json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  json header;
  try {
    header = json::parse(text, text + n, on_event);
  } catch (const json::exception& e) {
    fail(file, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) fail(file, "header is not a JSON object");
  if (!duplicate.empty()) fail_tensor(file, duplicate, "appears twice in the header");

  Parsed out;
  out.data_start = 8 + n;
  const uint64_t data_size = size - out.data_start;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) fail(file, "__metadata__ must be an object of strings");
      for (const auto& [k, mv] : v.items())
        if (!mv.is_string()) fail(file, "__metadata__ value for '" + k + "' is not a string");
      continue;
    }
    out.entries.push_back(parse_entry(name, v, data_size, file));
  }
  std::sort(out.entries.begin(), out.entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < out.entries.size(); ++i) {
    const Entry& prev = out.entries[i - 1];
    const Entry& cur = out.entries[i];
    if (cur.begin < prev.end)
      fail_tensor(file, cur.name, "data_offsets [" + std::to_string(cur.begin) + ", " + std::to_string(cur.end) +
                                      "] overlap tensor '" + prev.name + "' [" + std::to_string(prev.begin) +
                                      ", " + std::to_string(prev.end) + "]");
  }
  return out;
}

std::string build_header(const std::vector<Entry>& entries) {
  nlohmann::ordered_json h;
  h["__metadata__"] = {{"format", "pt"}};
  for (const Entry& e : entries) {
    nlohmann::ordered_json t;
    t["dtype"] = std::string(dtype_tag(e.dtype));
    t["shape"] = e.shape;
    t["data_offsets"] = {e.begin, e.end};
    h[e.name] = std::move(t);
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

}  // namespace strata::safetensors
