// Safetensors checkpoints: save -> open -> read_into bit-exact per dtype, conversions with
// round-to-nearest-even, byte-identical re-save, sharding with an index, malformed files
// (each error names the file and tensor), and crash-safe replacement of an existing directory.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/cleanup.h"
#include "src/checkpoint/file_util.h"
#include "src/checkpoint/hf.h"

using namespace strata;
using kernels::DType;
namespace fs = std::filesystem;

namespace {

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A tensor held in memory, in its stored bytes.
struct HostTensor {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype;
  std::vector<unsigned char> bytes;
};

HostTensor random_tensor(const std::string& name, std::vector<int64_t> shape, DType dtype, uint32_t seed) {
  HostTensor t{name, std::move(shape), dtype, {}};
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 3.f);
  t.bytes.resize(static_cast<size_t>(n) * kernels::dtype_size(dtype));
  for (int64_t i = 0; i < n; ++i) kernels::store_from_f32(t.bytes.data(), dtype, static_cast<size_t>(i), dist(rng));
  return t;
}

std::vector<TensorToSave> to_save(const std::vector<HostTensor>& ts) {
  std::vector<TensorToSave> out;
  for (const HostTensor& t : ts)
    out.push_back({t.name, t.shape, t.dtype, [&t](void* dst) {
      if (!t.bytes.empty()) std::memcpy(dst, t.bytes.data(), t.bytes.size());
    }});
  return out;
}

ModelConfig tiny_config() {
  ModelConfig c;
  c.vocab_size = 16;
  c.hidden_size = 8;
  c.n_layers = 1;
  c.n_heads = 2;
  c.n_kv_heads = 2;
  c.head_dim = 4;
  c.intermediate_size = 12;
  c.max_position_embeddings = 16;
  return c;
}

std::vector<HostTensor> sample_tensors() {
  return {random_tensor("model.embed_tokens.weight", {16, 8}, DType::f32, 1),
          random_tensor("model.layers.0.self_attn.q_proj.weight", {8, 8}, DType::bf16, 2),
          random_tensor("model.layers.0.mlp.up_proj.weight", {12, 8}, DType::f16, 3),
          random_tensor("model.layers.0.input_layernorm.weight", {8}, DType::f32, 4),
          random_tensor("model.norm.weight", {3}, DType::bf16, 5),  // odd byte count: padding between tensors
          random_tensor("scalar", {}, DType::f32, 6),
          random_tensor("empty", {0, 8}, DType::f16, 7)};
}

// A safetensors file from a header JSON string and data bytes; length_override replaces the
// 8-byte length prefix.
std::string raw_safetensors(const std::string& header, const std::string& data, int64_t length_override = -1) {
  uint64_t n = length_override >= 0 ? static_cast<uint64_t>(length_override) : header.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

class CheckpointDir : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::path(::testing::TempDir()) / "strata_ckpt_XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    root_ = templ;
  }
  void TearDown() override { fs::remove_all(root_); }

  // Writes `bytes` as <dir>/model.safetensors and expects open() to throw mentioning the file
  // and every needle.
  void expect_open_error(const std::string& bytes, std::initializer_list<std::string> needles) {
    fs::path dir = root_ / ("bad" + std::to_string(n_bad_++));
    fs::create_directories(dir);
    write_bytes(dir / "model.safetensors", bytes);
    expect_dir_error(dir, (dir / "model.safetensors").string(), needles);
  }
  void expect_dir_error(const fs::path& dir, const std::string& file, std::initializer_list<std::string> needles) {
    try {
      HfCheckpoint::open(dir);
      ADD_FAILURE() << "no error opening " << dir;
    } catch (const std::runtime_error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(file), std::string::npos) << msg;
      for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
    }
  }
  // Entries of `root_` whose names contain `part`.
  int count_entries_containing(const std::string& part) {
    int n = 0;
    for (const auto& e : fs::directory_iterator(root_))
      if (e.path().filename().string().find(part) != std::string::npos) ++n;
    return n;
  }

  fs::path root_;
  int n_bad_ = 0;
};

}  // namespace

TEST_F(CheckpointDir, SaveOpenReadIntoIsBitExact) {
  const auto ts = sample_tensors();
  fs::path dir = root_ / "model";
  save_hf_model(dir, tiny_config(), to_save(ts));
  EXPECT_TRUE(fs::exists(dir / "config.json"));
  EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  auto ck = HfCheckpoint::open(dir);
  ASSERT_EQ(ck->tensors().size(), ts.size());
  for (const HostTensor& t : ts) {
    const StoredTensor* st = ck->find(t.name);
    ASSERT_NE(st, nullptr) << t.name;
    EXPECT_EQ(st->dtype, t.dtype);
    EXPECT_EQ(st->shape, t.shape);
    EXPECT_EQ(st->nbytes, t.bytes.size());
    EXPECT_EQ(st->file, (dir / "model.safetensors").string());
    std::vector<unsigned char> back(t.bytes.size() + 1, 0xAB);
    ck->read_into(t.name, t.shape, back.data(), t.dtype);
    EXPECT_TRUE(std::equal(t.bytes.begin(), t.bytes.end(), back.begin())) << t.name;
    EXPECT_EQ(back.back(), 0xAB) << t.name << ": wrote past the end";
  }
  EXPECT_EQ(ck->find("nope"), nullptr);
  EXPECT_EQ(read_hf_config(dir / "config.json"), tiny_config());
}

TEST_F(CheckpointDir, FileLayoutIsWhatHfWrites) {
  const auto ts = sample_tensors();
  fs::path dir = root_ / "model";
  save_hf_model(dir, tiny_config(), to_save(ts));
  std::string bytes = read_file(dir / "model.safetensors");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ((8 + n) % 8, 0u) << "data area must start 8-byte aligned";
  nlohmann::json h = nlohmann::json::parse(bytes.substr(8, n));  // trailing spaces are valid JSON whitespace
  EXPECT_EQ(h["__metadata__"], nlohmann::json({{"format", "pt"}}));
  EXPECT_EQ(h.size(), ts.size() + 1);
  uint64_t total = 0;
  for (const HostTensor& t : ts) {
    const auto& e = h.at(t.name);
    uint64_t b = e["data_offsets"][0], end = e["data_offsets"][1];
    EXPECT_EQ(end - b, t.bytes.size());
    EXPECT_EQ(bytes.substr(8 + n + b, t.bytes.size()), std::string(t.bytes.begin(), t.bytes.end())) << t.name;
    total += t.bytes.size();
  }
  EXPECT_EQ(bytes.size(), 8 + n + total) << "tensors must be packed without gaps";
  EXPECT_EQ(h["model.layers.0.self_attn.q_proj.weight"]["dtype"], "BF16");
  EXPECT_EQ(h["model.layers.0.mlp.up_proj.weight"]["dtype"], "F16");
  EXPECT_EQ(h["scalar"]["shape"], nlohmann::json::array());
}

TEST_F(CheckpointDir, ReadIntoConvertsWithRoundToNearestEven) {
  HostTensor f = random_tensor("f", {5, 7}, DType::f32, 11);
  // Exact ties: 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125 (-> 1.0, even); 1 + 3·2^-8 -> 1.015625.
  float ties[2] = {1.00390625f, 1.01171875f};
  std::memcpy(f.bytes.data(), ties, sizeof(ties));
  HostTensor b = random_tensor("b", {33}, DType::bf16, 12);
  HostTensor h = random_tensor("h", {2, 3, 4}, DType::f16, 13);
  fs::path dir = root_ / "model";
  save_hf_model(dir, tiny_config(), to_save({f, b, h}));
  auto ck = HfCheckpoint::open(dir);

  std::vector<uint16_t> f_as_bf16(35), f_as_f16(35);
  ck->read_into("f", {5, 7}, f_as_bf16.data(), DType::bf16);
  ck->read_into("f", {5, 7}, f_as_f16.data(), DType::f16);
  for (size_t i = 0; i < 35; ++i) {
    float x = kernels::load_as_f32(f.bytes.data(), DType::f32, i);
    EXPECT_EQ(f_as_bf16[i], kernels::f32_to_bf16(x)) << i;
    EXPECT_EQ(f_as_f16[i], kernels::f32_to_f16(x)) << i;
  }
  EXPECT_EQ(f_as_bf16[0], 0x3f80);  // 1.0
  EXPECT_EQ(f_as_bf16[1], 0x3f82);  // 1.015625

  std::vector<float> b_as_f32(33);
  ck->read_into("b", {33}, b_as_f32.data(), DType::f32);
  std::vector<uint16_t> b_as_f16(33);
  ck->read_into("b", {33}, b_as_f16.data(), DType::f16);
  for (size_t i = 0; i < 33; ++i) {
    float x = kernels::load_as_f32(b.bytes.data(), DType::bf16, i);
    EXPECT_EQ(b_as_f32[i], x);
    EXPECT_EQ(b_as_f16[i], kernels::f32_to_f16(x));
  }
  std::vector<float> h_as_f32(24);
  ck->read_into("h", {2, 3, 4}, h_as_f32.data(), DType::f32);
  for (size_t i = 0; i < 24; ++i) EXPECT_EQ(h_as_f32[i], kernels::load_as_f32(h.bytes.data(), DType::f16, i));
}

TEST_F(CheckpointDir, ReadIntoChecksNameAndShape) {
  fs::path dir = root_ / "model";
  save_hf_model(dir, tiny_config(), to_save(sample_tensors()));
  auto ck = HfCheckpoint::open(dir);
  std::vector<float> buf(256);
  try {
    ck->read_into("model.norm.weight", {4}, buf.data(), DType::f32);
    FAIL();
  } catch (const std::runtime_error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("model.norm.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(4)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(3)"), std::string::npos) << msg;
  }
  try {
    ck->read_into("lm_head.weight", {16, 8}, buf.data(), DType::f32);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("lm_head.weight"), std::string::npos) << e.what();
  }
}

TEST_F(CheckpointDir, SaveLoadSaveIsByteIdentical) {
  fs::path a = root_ / "a", b = root_ / "b";
  save_hf_model(a, tiny_config(), to_save(sample_tensors()), 200);  // sharded, to cover the index too
  auto ck = HfCheckpoint::open(a);
  std::vector<TensorToSave> again;
  for (const StoredTensor& t : ck->tensors())
    again.push_back({t.name, t.shape, t.dtype, [&t](void* dst) {
      if (t.nbytes) std::memcpy(dst, t.data, t.nbytes);
    }});
  // tensors() is in file order, which is the order they were saved in.
  save_hf_model(b, read_hf_config(a / "config.json"), again, 200);
  std::vector<std::string> names_a, names_b;
  for (const auto& e : fs::directory_iterator(a)) names_a.push_back(e.path().filename());
  for (const auto& e : fs::directory_iterator(b)) names_b.push_back(e.path().filename());
  std::sort(names_a.begin(), names_a.end());
  std::sort(names_b.begin(), names_b.end());
  ASSERT_EQ(names_a, names_b);
  EXPECT_GT(names_a.size(), 3u);
  for (const std::string& n : names_a) EXPECT_EQ(read_file(a / n), read_file(b / n)) << n;
}

TEST_F(CheckpointDir, ShardedSaveWritesIndexAndReadsBack) {
  const auto ts = sample_tensors();
  fs::path dir = root_ / "model";
  save_hf_model(dir, tiny_config(), to_save(ts), 300);
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  nlohmann::json index = nlohmann::json::parse(std::ifstream(dir / "model.safetensors.index.json"));
  uint64_t total = 0;
  for (const HostTensor& t : ts) total += t.bytes.size();
  EXPECT_EQ(index["metadata"]["total_size"], total);
  ASSERT_EQ(index["weight_map"].size(), ts.size());
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
  // 512 | 128 | 192 + 32 + 6 + 4 + 0 bytes, in order, at most 300 per shard unless one tensor is larger.
  EXPECT_EQ(files, (std::set<std::string>{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                          "model-00003-of-00003.safetensors"}));
  for (const std::string& f : files) EXPECT_TRUE(fs::exists(dir / f)) << f;
  EXPECT_EQ(index["weight_map"]["model.embed_tokens.weight"], "model-00001-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["model.layers.0.self_attn.q_proj.weight"], "model-00002-of-00003.safetensors");

  auto ck = HfCheckpoint::open(dir);
  ASSERT_EQ(ck->tensors().size(), ts.size());
  for (const HostTensor& t : ts) {
    std::vector<unsigned char> back(t.bytes.size());
    ck->read_into(t.name, t.shape, back.data(), t.dtype);
    EXPECT_EQ(back, t.bytes) << t.name;
    EXPECT_EQ(ck->find(t.name)->file, (dir / index["weight_map"][t.name].get<std::string>()).string());
  }
}

TEST_F(CheckpointDir, MalformedFilesNameFileAndTensor) {
  const std::string ok_entry = R"("w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]})";
  const std::string data16(16, '\x01');
  // Sanity: the well-formed version opens.
  {
    fs::path dir = root_ / "good";
    fs::create_directories(dir);
    write_bytes(dir / "model.safetensors", raw_safetensors("{" + ok_entry + "}", data16));
    EXPECT_EQ(HfCheckpoint::open(dir)->tensors().size(), 1u);
  }
  expect_open_error(std::string("\x10\x00\x00", 3), {"too small"});
  expect_open_error(raw_safetensors("{" + ok_entry + "}", data16, 4096), {"past the end"});
  expect_open_error(raw_safetensors("{" + ok_entry + "}", data16, int64_t{1} << 40), {"limit"});
  expect_open_error(raw_safetensors("{\"w\": [1, 2", data16), {"not valid JSON"});
  expect_open_error(raw_safetensors("[1, 2]", data16), {"not a JSON object"});
  expect_open_error(raw_safetensors("{" + ok_entry + "}", data16.substr(0, 10)), {"'w'", "past the end"});
  expect_open_error(
      raw_safetensors(R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]}})", data16),
      {"'w'", "past the end"});
  expect_open_error(raw_safetensors(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                                    data16),
                    {"'b'", "overlap", "'a'"});
  expect_open_error(raw_safetensors(R"({"w": {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 16]}})", data16),
                    {"'w'", "24 bytes", "16"});
  expect_open_error(raw_safetensors(R"({"w": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}})", data16),
                    {"'w'", "I64"});
  expect_open_error(
      raw_safetensors(R"({"w": {"dtype": "F8_E4M3", "shape": [16], "data_offsets": [0, 16]}})", data16),
      {"'w'", "F8_E4M3"});
  expect_open_error(raw_safetensors(R"({"w": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}})", data16),
                    {"'w'", "non-negative"});
  expect_open_error(raw_safetensors(R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}})", data16),
                    {"'w'", "begin after end"});
  expect_open_error(raw_safetensors(R"({"w": {"dtype": "F32", "shape": [2, 2]}})", data16), {"'w'", "data_offsets"});
  expect_open_error(raw_safetensors(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                        "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                                    data16),
                    {"'w'", "twice"});
  expect_open_error(
      raw_safetensors(R"({"__metadata__": {"format": 1}, )" + ok_entry + "}", data16), {"__metadata__"});

  // Deep nesting must not overflow the stack.
  const std::string deep = "{\"w\": " + std::string(200000, '[') + std::string(200000, ']') + "}";
  expect_open_error(raw_safetensors(deep, data16), {"nests deeper"});

  // A real file cut short: the last tensor's range now runs past the end.
  fs::path good = root_ / "model";
  save_hf_model(good, tiny_config(), to_save(sample_tensors()));
  std::string bytes = read_file(good / "model.safetensors");
  expect_open_error(bytes.substr(0, bytes.size() - 5), {"past the end", "'"});
}

TEST_F(CheckpointDir, BrokenIndexNamesIndexAndShard) {
  const auto ts = sample_tensors();
  fs::path dir = root_ / "model";
  save_hf_model(dir, tiny_config(), to_save(ts), 300);
  const fs::path index = dir / "model.safetensors.index.json";
  const std::string original = read_file(index);

  // A shard the index names is missing.
  fs::rename(dir / "model-00003-of-00003.safetensors", root_ / "moved");
  expect_dir_error(dir, index.string(), {"model-00003-of-00003.safetensors", "does not exist"});
  fs::rename(root_ / "moved", dir / "model-00003-of-00003.safetensors");
  EXPECT_NO_THROW(HfCheckpoint::open(dir));

  // The index puts a tensor in the wrong shard.
  nlohmann::json j = nlohmann::json::parse(original);
  j["weight_map"]["model.norm.weight"] = "model-00001-of-00003.safetensors";
  write_bytes(index, j.dump());
  expect_dir_error(dir, index.string(), {"model.norm.weight", "is in", "model-00003-of-00003"});

  // The index names a tensor no shard holds.
  j = nlohmann::json::parse(original);
  j["weight_map"]["lm_head.weight"] = "model-00001-of-00003.safetensors";
  write_bytes(index, j.dump());
  expect_dir_error(dir, index.string(), {"lm_head.weight", "no shard holds it"});

  // Path escapes and junk.
  j = nlohmann::json::parse(original);
  j["weight_map"]["model.norm.weight"] = "../model-00003-of-00003.safetensors";
  write_bytes(index, j.dump());
  expect_dir_error(dir, index.string(), {"model.norm.weight"});
  write_bytes(index, "{\"metadata\": {}}");
  expect_dir_error(dir, index.string(), {"weight_map"});
  write_bytes(index, original);

  // The same tensor in two shards.
  fs::path single = root_ / "single";
  save_hf_model(single, tiny_config(), to_save({ts[0]}));
  fs::copy_file(single / "model.safetensors", dir / "model-00002-of-00003.safetensors",
                fs::copy_options::overwrite_existing);
  try {
    HfCheckpoint::open(dir);
    FAIL();
  } catch (const std::runtime_error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("model.embed_tokens.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("model-0000"), std::string::npos) << msg;
  }
  expect_dir_error(root_ / "nothing_here", (root_ / "nothing_here").string(), {"model.safetensors"});
}

// A tensor with fill_range is staged a piece (kSavePieceBytes) at a time, in order, each piece
// whole elements, and the file is byte for byte the one a whole fill writes; a failing piece
// names the tensor.
TEST_F(CheckpointDir, ARangedFillIsStagedInPiecesAndSavesTheSameBytes) {
  const int64_t rows = static_cast<int64_t>(kSavePieceBytes / 2 / 64) * 2 + 3;  // bf16, 64 wide: 2 pieces and a bit
  HostTensor big;
  big.name = "model.big_table.weight";
  big.shape = {rows, 64};
  big.dtype = DType::bf16;
  big.bytes.resize(static_cast<size_t>(rows) * 64 * 2);
  for (size_t i = 0; i < big.bytes.size(); ++i) big.bytes[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  const std::vector<HostTensor> small = sample_tensors();
  std::vector<TensorToSave> whole = to_save(small);
  whole.push_back({.name = big.name, .shape = big.shape, .dtype = big.dtype,
                   .fill = [&big](void* dst) { std::memcpy(dst, big.bytes.data(), big.bytes.size()); }, .fill_range = {}});
  save_hf_model(root_ / "whole", tiny_config(), whole);

  std::vector<TensorToSave> ranged = to_save(small);
  std::vector<std::pair<uint64_t, uint64_t>> asked;
  ranged.push_back({.name = big.name, .shape = big.shape, .dtype = big.dtype, .fill = {},
                    .fill_range = [&](void* dst, uint64_t at, uint64_t n) {
                      asked.emplace_back(at, n);
                      std::memcpy(dst, big.bytes.data() + at, n);
                    }});
  save_hf_model(root_ / "ranged", tiny_config(), ranged);
  ASSERT_EQ(asked.size(), 3u);
  uint64_t next = 0;
  for (const auto& [at, n] : asked) {
    EXPECT_EQ(at, next);
    EXPECT_LE(n, kSavePieceBytes);
    EXPECT_EQ(n % 2, 0u);
    next = at + n;
  }
  EXPECT_EQ(next, big.bytes.size());
  EXPECT_EQ(read_file(root_ / "ranged" / "model.safetensors"), read_file(root_ / "whole" / "model.safetensors"));

  ranged.back().fill_range = [](void*, uint64_t at, uint64_t) {
    if (at > 0) throw std::runtime_error("piece fetch failed");
  };
  try {
    save_hf_model(root_ / "ranged", tiny_config(), ranged);
    FAIL();
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("piece fetch failed"), std::string::npos) << msg;
    EXPECT_NE(msg.find(big.name), std::string::npos) << msg;
  }
  EXPECT_EQ(read_file(root_ / "ranged" / "model.safetensors"), read_file(root_ / "whole" / "model.safetensors"));
}

TEST_F(CheckpointDir, FailedSaveLeavesOldDirectoryIntact) {
  fs::path dir = root_ / "model";
  save_hf_model(dir, tiny_config(), to_save(sample_tensors()));
  std::map<std::string, std::string> before;
  for (const auto& e : fs::directory_iterator(dir)) before[e.path().filename()] = read_file(e.path());

  const auto host = sample_tensors();  // the fill callbacks point into it
  auto ts = to_save(host);
  ts[2].fill = [](void*) { throw std::runtime_error("parameter fetch failed"); };
  try {
    save_hf_model(dir, tiny_config(), ts);
    FAIL();
  } catch (const std::runtime_error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("parameter fetch failed"), std::string::npos) << msg;
    EXPECT_NE(msg.find(ts[2].name), std::string::npos) << msg;
  }
  std::map<std::string, std::string> after;
  for (const auto& e : fs::directory_iterator(dir)) after[e.path().filename()] = read_file(e.path());
  EXPECT_EQ(before, after);
  EXPECT_EQ(count_entries_containing(".tmp-"), 0);
  EXPECT_EQ(count_entries_containing(".old-"), 0);
  EXPECT_NO_THROW(HfCheckpoint::open(dir));

  // Invalid input fails before anything is written.
  auto dup = to_save(host);
  dup[1].name = dup[0].name;
  EXPECT_THROW(save_hf_model(dir, tiny_config(), dup), std::invalid_argument);
  EXPECT_EQ(count_entries_containing(".tmp-"), 0);
}

TEST_F(CheckpointDir, SuccessfulSaveReplacesOldDirectory) {
  fs::path dir = root_ / "model";
  save_hf_model(dir, tiny_config(), to_save(sample_tensors()), 300);  // sharded
  auto ts = sample_tensors();
  ts.resize(2);
  save_hf_model(dir, tiny_config(), to_save(ts));  // single file now
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "model-00001-of-00003.safetensors"));
  EXPECT_EQ(HfCheckpoint::open(dir)->tensors().size(), 2u);
  EXPECT_EQ(count_entries_containing(".tmp-"), 0);
  EXPECT_EQ(count_entries_containing(".old-"), 0);
  // A trailing slash still saves to (and replaces) the same directory.
  save_hf_model(dir.string() + "/", tiny_config(), to_save(sample_tensors()));
  EXPECT_EQ(HfCheckpoint::open(dir)->tensors().size(), sample_tensors().size());
  EXPECT_EQ(count_entries_containing(".tmp-"), 0);
}

// A save replaces the whole directory, so it refuses one holding anything it did not write, and
// the working directory, its parents and the root, before writing anything.
TEST_F(CheckpointDir, SaveNeverReplacesFilesItDidNotWrite) {
  fs::path dir = root_ / "v";
  fs::create_directories(dir / "sub");
  write_bytes(dir / "thesis.txt", "hi");
  for (const fs::path& out : {dir, fs::path(dir.string() + "/")}) {
    try {
      check_hf_save_target(out);
      FAIL() << out;
    } catch (const std::runtime_error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(dir.string()), std::string::npos) << msg;
      EXPECT_NE(msg.find("thesis.txt"), std::string::npos) << msg;
      EXPECT_NE(msg.find("sub/"), std::string::npos) << msg;
      EXPECT_NE(msg.find("new directory"), std::string::npos) << msg;
    }
    EXPECT_THROW(save_hf_model(out, tiny_config(), to_save(sample_tensors())), std::runtime_error);
  }
  EXPECT_EQ(read_file(dir / "thesis.txt"), "hi");
  EXPECT_TRUE(fs::is_directory(dir / "sub"));
  EXPECT_EQ(count_entries_containing(".tmp-"), 0);

  // A stray file next to a saved model is kept too.
  fs::path model = root_ / "model";
  save_hf_model(model, tiny_config(), to_save(sample_tensors()), 300);
  write_bytes(model / "notes.md", "mine");
  EXPECT_THROW(save_hf_model(model, tiny_config(), to_save(sample_tensors())), std::runtime_error);
  EXPECT_EQ(read_file(model / "notes.md"), "mine");
  fs::remove(model / "notes.md");
  EXPECT_NO_THROW(check_hf_save_target(model));  // only what a save writes: replaceable
  // An empty directory is fine.
  fs::create_directories(root_ / "empty");
  EXPECT_NO_THROW(save_hf_model(root_ / "empty", tiny_config(), to_save(sample_tensors())));

  // ".", "..", the working directory, a parent of it, and the root.
  const fs::path cwd = fs::current_path();
  fs::create_directories(root_ / "work");
  fs::current_path(root_ / "work");
  for (const fs::path& out : {fs::path("."), fs::path("./"), fs::path(".."), fs::path("x/.."), root_ / "work",
                              root_, fs::path("/")}) {
    try {
      check_hf_save_target(out);
      ADD_FAILURE() << out << " accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("new directory"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(fs::is_directory(root_ / "work"));
  EXPECT_TRUE(fs::exists(dir / "thesis.txt"));
  fs::current_path(cwd);
}

// Temporary directories of a save that was killed (its pid is gone) are removed by the next
// save to the same place; those of a live process, and anything else, are not.
// A save or checkpoint being written (TempDir) is removed by the signal handler's emergency
// cleanup (a second Ctrl-C in the middle of it); a released one (renamed into place) is not.
TEST_F(CheckpointDir, ATemporaryDirectoryBeingWrittenGoesWithASecondSignal) {
  const fs::path writing = make_owned_temp_dir(root_ / "out", ".tmp-"), done = make_owned_temp_dir(root_ / "ck", ".tmp-");
  {
    TempDir a(writing), b(done);
    for (const fs::path& d : {writing, done}) std::ofstream(d / "model.safetensors") << "bytes";
    b.release();
    strata::io::emergency_cleanup();
    EXPECT_FALSE(fs::exists(writing));
    EXPECT_TRUE(fs::exists(done / "model.safetensors"));
  }
}

// A TempDir made by create_owned is registered before the directory exists, so no instant of
// its life is unregistered; the name is the owned pattern the next run's cleanup recognises,
// and two in a row differ.
TEST_F(CheckpointDir, AnOwnedTemporaryDirectoryIsRegisteredFromItsCreation) {
  TempDir a = TempDir::create_owned(root_ / "out", ".tmp-"), b = TempDir::create_owned(root_ / "out", ".tmp-");
  const std::string prefix = "out.tmp-" + std::to_string(::getpid()) + "-";
  for (const TempDir* t : {&a, &b}) {
    ASSERT_TRUE(fs::is_directory(t->path()));
    const std::string name = t->path().filename().string();
    EXPECT_EQ(name.rfind(prefix, 0), 0u) << name;
    EXPECT_EQ(name.size(), prefix.size() + 6) << name;
    EXPECT_EQ(fs::status(t->path()).permissions() & fs::perms::all, fs::perms::owner_all);
  }
  EXPECT_NE(a.path(), b.path());
  std::ofstream(a.path() / "model.safetensors") << "bytes";
  strata::io::emergency_cleanup();
  EXPECT_FALSE(fs::exists(a.path()));
  EXPECT_FALSE(fs::exists(b.path()));
  EXPECT_THROW(TempDir::create_owned(root_ / "missing" / "x", ".tmp-"), std::runtime_error);
}

TEST_F(CheckpointDir, LeftoversOfKilledSavesAreRemoved) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // a pid that is now dead
  const std::string dead = std::to_string(child), live = std::to_string(::getpid());
  for (const std::string& name : {"model.tmp-" + dead + "-abc123", "model.old-" + dead + "-abc123",
                                 "model.tmp-" + live + "-abc123", std::string("model.tmp-x-abc123"), "other.tmp-" + dead + "-a"}) {
    fs::create_directories(root_ / name);
    write_bytes(root_ / name / "model.safetensors", "partial");
  }
  save_hf_model(root_ / "model", tiny_config(), to_save(sample_tensors()));
  EXPECT_FALSE(fs::exists(root_ / ("model.tmp-" + dead + "-abc123")));
  EXPECT_FALSE(fs::exists(root_ / ("model.old-" + dead + "-abc123")));
  EXPECT_TRUE(fs::exists(root_ / ("model.tmp-" + live + "-abc123")));
  EXPECT_TRUE(fs::exists(root_ / "model.tmp-x-abc123"));
  EXPECT_TRUE(fs::exists(root_ / ("other.tmp-" + dead + "-a")));
}

// A writer that exited but was never reaped (a zombie: an mpirun rank killed after its
// launcher exited, reparented to a pid 1 that does not reap) left its temporary directory too.
TEST_F(CheckpointDir, LeftoversOfAnExitedButUnreapedWriterAreRemoved) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  const std::string name = "model.tmp-" + std::to_string(child) + "-abc123";
  fs::create_directories(root_ / name);
  // Until it has exited (kill(pid, 0) still succeeds on the zombie).
  for (int i = 0; i < 2000; ++i) {
    siginfo_t info{};
    ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOHANG | WNOWAIT), 0);
    if (info.si_pid == child) break;
    ::usleep(1000);
  }
  ASSERT_EQ(::kill(child, 0), 0) << "the child should be a zombie still";
  EXPECT_EQ(remove_dead_pid_dirs(root_, "model.tmp-", false), 1);
  EXPECT_FALSE(fs::exists(root_ / name));
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
}

// The split rule at its boundary: tensors that add up to exactly shard_bytes stay in one file;
// one byte more starts a second shard.
TEST_F(CheckpointDir, ShardSplitsOnlyPastTheLimit) {
  const auto ts = sample_tensors();
  std::vector<HostTensor> two{ts[0], ts[3]};  // 512 + 32 bytes
  const uint64_t total = two[0].bytes.size() + two[1].bytes.size();
  save_hf_model(root_ / "exact", tiny_config(), to_save(two), total);
  EXPECT_TRUE(fs::exists(root_ / "exact" / "model.safetensors"));
  EXPECT_FALSE(fs::exists(root_ / "exact" / "model.safetensors.index.json"));
  save_hf_model(root_ / "over", tiny_config(), to_save(two), total - 1);
  EXPECT_FALSE(fs::exists(root_ / "over" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(root_ / "over" / "model-00001-of-00002.safetensors"));
  EXPECT_TRUE(fs::exists(root_ / "over" / "model-00002-of-00002.safetensors"));
  EXPECT_EQ(HfCheckpoint::open(root_ / "over")->tensors().size(), 2u);
}

// A NaN or Inf weight is refused at load, naming the file, the tensor and the element.
// A range of a tensor (a ZeRO shard's part of it) is the whole tensor's values there, converted
// the same; only the range is checked for non-finite values, and a range outside is refused.
TEST_F(CheckpointDir, ReadRangeIsThatPartOfTheWholeTensor) {
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    auto ts = sample_tensors();
    HostTensor& t = ts[1];
    t = random_tensor(t.name, t.shape, dt, 9);
    int64_t numel = 1;
    for (int64_t x : t.shape) numel *= x;
    ASSERT_GE(numel, 12);
    kernels::store_from_f32(t.bytes.data(), dt, static_cast<size_t>(numel - 1), std::numeric_limits<float>::quiet_NaN());
    const fs::path dir = root_ / "range";
    fs::remove_all(dir);
    save_hf_model(dir, tiny_config(), to_save(ts));
    auto ck = HfCheckpoint::open(dir);
    std::vector<float> whole(static_cast<size_t>(numel - 1));
    for (int64_t i = 0; i + 1 < numel; ++i) whole[static_cast<size_t>(i)] = kernels::load_as_f32(t.bytes.data(), dt, static_cast<size_t>(i));
    for (const auto& [a, b] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {3, 11}, {5, numel - 1}, {7, 7}}) {
      std::vector<float> got(static_cast<size_t>(b - a) + 1, -7.f);
      ck->read_range(t.name, t.shape, a, b, got.data(), DType::f32);
      for (int64_t i = a; i < b; ++i)
        EXPECT_EQ(got[static_cast<size_t>(i - a)], whole[static_cast<size_t>(i)]) << t.name << " element " << i;
      EXPECT_EQ(got.back(), -7.f) << "wrote past the range";
    }
    try {  // the last element is NaN: a range holding it is refused, naming its element in the tensor
      std::vector<float> got(4);
      ck->read_range(t.name, t.shape, numel - 3, numel, got.data(), DType::f32);
      ADD_FAILURE() << "accepted a non-finite value";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("element " + std::to_string(numel - 1)), std::string::npos) << e.what();
    }
    std::vector<float> got(static_cast<size_t>(numel) + 1);
    EXPECT_THROW(ck->read_range(t.name, t.shape, 2, numel + 1, got.data(), DType::f32), std::logic_error);
    EXPECT_THROW(ck->read_range(t.name, t.shape, 4, 3, got.data(), DType::f32), std::logic_error);
  }
}

// The resident pages (kB) of this process's mapping that holds address p (/proc/self/smaps).
long mapped_rss_kb(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(p);
  bool in = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      in = at >= lo && at < hi;
      continue;
    }
    long kb = 0;
    if (in && std::sscanf(line.c_str(), "Rss: %ld kB", &kb) == 1) return kb;
  }
  return -1;
}

// A read lets go of the file's pages it has read: a load or a resume would otherwise keep every
// byte of the checkpoint it read in the process's RSS until the file is closed.
TEST_F(CheckpointDir, AReadLeavesNoFilePagesResident) {
  const std::vector<HostTensor> ts = {random_tensor("big", {1024, 2048}, DType::f32, 3)};  // 8 MiB
  save_hf_model(root_ / "m", tiny_config(), to_save(ts));
  auto ck = HfCheckpoint::open(root_ / "m");
  const StoredTensor* st = ck->find("big");
  ASSERT_NE(st, nullptr);
  std::vector<float> out(1024 * 2048);
  ck->read_range("big", {1024, 2048}, 0, 1024 * 1024, out.data(), DType::f32);  // the first half
  ck->read_into("big", {1024, 2048}, out.data(), DType::f32);
  const long kb = mapped_rss_kb(st->data);
  ASSERT_GE(kb, 0) << "no mapping holds the tensor";
  EXPECT_LT(kb, 64) << "the 8 MiB read stayed resident";
  EXPECT_EQ(std::memcmp(out.data(), ts[0].bytes.data(), ts[0].bytes.size()), 0);  // (and read right)
}

TEST_F(CheckpointDir, NonFiniteWeightsAreRefusedNamingTheTensor) {
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
      auto ts = sample_tensors();
      HostTensor& t = ts[1];
      t = random_tensor(t.name, t.shape, dt, 9);
      kernels::store_from_f32(t.bytes.data(), dt, 5, bad);
      const fs::path dir = root_ / "bad";
      fs::remove_all(dir);
      save_hf_model(dir, tiny_config(), to_save(ts));
      auto ck = HfCheckpoint::open(dir);
      std::vector<float> out(256);
      try {
        ck->read_into(t.name, t.shape, out.data(), DType::f32);
        ADD_FAILURE() << "accepted a non-finite value";
      } catch (const std::runtime_error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(t.name), std::string::npos) << msg;
        EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
        EXPECT_NE(msg.find("element 5"), std::string::npos) << msg;
      }
      EXPECT_NO_THROW(ck->read_into(ts[0].name, ts[0].shape, out.data(), DType::f32));  // the others still load
    }
  }
}

TEST_F(CheckpointDir, UnwritablePathFailsNamingIt) {
  // A parent that is a regular file cannot hold a directory, even for root.
  write_bytes(root_ / "afile", "x");
  fs::path out = root_ / "afile" / "model";
  try {
    save_hf_model(out, tiny_config(), to_save(sample_tensors()));
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(out.string()), std::string::npos) << e.what();
  }
  // An existing regular file at out_dir is not replaced.
  try {
    save_hf_model(root_ / "afile", tiny_config(), to_save(sample_tensors()));
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("afile"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_file(root_ / "afile"), "x");
  EXPECT_EQ(count_entries_containing(".tmp-"), 0);
}

TEST_F(CheckpointDir, ReplaceDirectoryWithoutExchange) {
  // The path taken on filesystems without RENAME_EXCHANGE: old aside, new in, old removed.
  for (bool use_exchange : {true, false}) {
    fs::path out = root_ / "out", tmp = root_ / "out.tmp-x";
    fs::create_directories(out);
    write_bytes(out / "old.txt", "old");
    fs::create_directories(tmp);
    write_bytes(tmp / "new.txt", "new");
    replace_directory(tmp, out, use_exchange);
    EXPECT_EQ(read_file(out / "new.txt"), "new");
    EXPECT_FALSE(fs::exists(out / "old.txt"));
    EXPECT_FALSE(fs::exists(tmp));
    EXPECT_EQ(count_entries_containing(".old-"), 0);
    // A missing tmp fails and leaves `out` as it was.
    EXPECT_THROW(replace_directory(root_ / "no_such_tmp", out, use_exchange), std::runtime_error);
    EXPECT_EQ(read_file(out / "new.txt"), "new");
    EXPECT_EQ(count_entries_containing(".old-"), 0);
    fs::remove_all(out);
  }
}

TEST(CheckpointFiles, DiskFullNamesPathAndOffset) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full on this system";
  try {
    write_file_synced("/dev/full", std::string(100, 'x'));
    FAIL();
  } catch (const std::runtime_error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("/dev/full"), std::string::npos) << msg;
    EXPECT_NE(msg.find("offset 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("No space left"), std::string::npos) << msg;
  }
}

TEST_F(CheckpointDir, MutatedFilesFailCleanly) {
  // Random byte flips and truncations of a valid file: open either succeeds (and every tensor
  // then reads within bounds) or throws std::runtime_error; nothing else (run under ASan too).
  fs::path good = root_ / "good";
  save_hf_model(good, tiny_config(), to_save(sample_tensors()));
  const std::string original = read_file(good / "model.safetensors");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(original[i]);
  fs::path dir = root_ / "mutated";
  fs::create_directories(dir);
  fs::copy_file(good / "config.json", dir / "config.json");
  std::mt19937 rng(1234);
  int opened = 0, rejected = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::string bytes = original;
    if (trial % 5 == 4) {
      bytes.resize(rng() % bytes.size());
    } else {
      int flips = 1 + static_cast<int>(rng() % 3);
      for (int f = 0; f < flips; ++f) {
        // Mostly inside the length prefix and header, where the parser is exposed.
        size_t at = rng() % (trial % 3 == 0 ? 8 : 8 + header_len);
        bytes[at] = static_cast<char>(rng() % 256);
      }
    }
    fs::remove(dir / "model.safetensors");  // not truncate: ext4 flushes truncated-and-rewritten files on close
    write_bytes(dir / "model.safetensors", bytes);
    try {
      auto ck = HfCheckpoint::open(dir);
      ++opened;
      for (const StoredTensor& t : ck->tensors()) {
        std::vector<float> out(t.nbytes / kernels::dtype_size(t.dtype) + 1);
        ck->read_into(t.name, t.shape, out.data(), DType::f32);
      }
    } catch (const std::runtime_error& e) {
      ++rejected;
      EXPECT_NE(std::string(e.what()).find("model.safetensors"), std::string::npos) << e.what();
    }
  }
  EXPECT_GT(rejected, 100);
  EXPECT_GT(opened, 0);  // flips inside tensor names or padding still parse
}
