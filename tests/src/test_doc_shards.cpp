// The loss-mask and document sidecars of token shards (src/data/doc_shards.h): a shard set
// written document by document reads back exactly (ids through the llm.c reader, masks and
// document offsets through the sidecar readers), shards split at document boundaries, a
// document longer than a shard gets its own, nothing named *.bin exists until a shard is
// complete, an abandoned writer leaves no file, and damaged sidecars are errors naming the file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "src/data/doc_shards.h"
#include "src/data/token_shards.h"

using namespace strata;
namespace fs = std::filesystem;

namespace {

class DocShards : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::path(::testing::TempDir()) / "strata_docshards_XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::vector<std::string> names() const {
    std::vector<std::string> v;
    for (const auto& e : fs::directory_iterator(dir_)) v.push_back(e.path().filename().string());
    std::sort(v.begin(), v.end());
    return v;
  }
  fs::path dir_;
};

// Document d has length lens[d]; token values and mask bits are a function of (d, i).
struct Docs {
  std::vector<std::vector<uint32_t>> ids;
  std::vector<std::vector<uint8_t>> mask;
};
Docs make_docs(const std::vector<size_t>& lens, uint32_t vocab) {
  Docs d;
  for (size_t k = 0; k < lens.size(); ++k) {
    std::vector<uint32_t> ids(lens[k]);
    std::vector<uint8_t> m(lens[k]);
    for (size_t i = 0; i < lens[k]; ++i) {
      ids[i] = static_cast<uint32_t>((k * 7919 + i * 31) % vocab);
      m[i] = static_cast<uint8_t>((k + i) % 3 != 0);
    }
    d.ids.push_back(ids);
    d.mask.push_back(m);
  }
  return d;
}

TEST_F(DocShards, RoundTripSplitsAtDocumentBoundaries) {
  for (int version : {1, 7}) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    const uint32_t vocab = version == 1 ? 65536 : 200000;
    const Docs d = make_docs({5, 3, 9, 1, 20, 4, 4}, vocab);
    ShardSetWriter w(dir_, "train", 12, version);
    for (size_t k = 0; k < d.ids.size(); ++k) w.add_document(d.ids[k].data(), d.mask[k].data(), d.ids[k].size());
    const std::vector<std::string> shards = w.finish();
    // 5+3 | 9+1 | 20 (longer than a shard: alone) | 4+4
    ASSERT_EQ(shards.size(), 4u);
    EXPECT_EQ(shards[0], "train_000000.bin");
    EXPECT_EQ(shards[3], "train_000003.bin");
    const std::vector<std::vector<size_t>> docs_of = {{0, 1}, {2, 3}, {4}, {5, 6}};
    for (size_t s = 0; s < shards.size(); ++s) {
      const fs::path p = dir_ / shards[s];
      auto shard = TokenShard::open(p);
      EXPECT_EQ(shard->token_bytes(), version == 1 ? 2u : 4u);
      const std::vector<uint8_t> mask = read_shard_mask(p, shard->n_tokens());
      const std::vector<int64_t> off = read_shard_docs(p, shard->n_tokens());
      ASSERT_EQ(off.size(), docs_of[s].size() + 1);
      for (size_t j = 0; j < docs_of[s].size(); ++j) {
        const size_t k = docs_of[s][j];
        ASSERT_EQ(off[j + 1] - off[j], static_cast<int64_t>(d.ids[k].size()));
        for (size_t i = 0; i < d.ids[k].size(); ++i) {
          EXPECT_EQ(shard->token(off[j] + static_cast<int64_t>(i)), d.ids[k][i]);
          EXPECT_EQ(mask[static_cast<size_t>(off[j]) + i], d.mask[k][i]);
        }
      }
    }
    EXPECT_EQ(w.documents(), 7);
    EXPECT_EQ(w.tokens(), 46);
  }
}

TEST_F(DocShards, NoShardIsVisibleBeforeItIsCompleteAndAnAbandonedWriterLeavesNothing) {
  const Docs d = make_docs({6, 6, 6}, 1000);
  {
    ShardSetWriter w(dir_, "val", 12, 1);
    w.add_document(d.ids[0].data(), d.mask[0].data(), 6);
    w.add_document(d.ids[1].data(), d.mask[1].data(), 6);
    for (const std::string& n : names()) EXPECT_NE(fs::path(n).extension(), ".bin") << n;
    w.add_document(d.ids[2].data(), d.mask[2].data(), 6);  // closes the first shard
    EXPECT_TRUE(fs::exists(dir_ / "val_000000.bin"));
    EXPECT_TRUE(fs::exists(dir_ / "val_000000.mask"));
    EXPECT_TRUE(fs::exists(dir_ / "val_000000.docs"));
    EXPECT_FALSE(fs::exists(dir_ / "val_000001.bin"));
  }  // destroyed without finish(): the open shard's partial files go, complete shards stay
  EXPECT_EQ(names(), (std::vector<std::string>{"val_000000.bin", "val_000000.docs", "val_000000.mask"}));
}

TEST_F(DocShards, Version1RefusesIdsPast16Bits) {
  ShardSetWriter w(dir_, "train", 100, 1);
  const uint32_t ids[2] = {1, 70000};
  const uint8_t mask[2] = {1, 1};
  EXPECT_THROW(w.add_document(ids, mask, 2), std::runtime_error);
}

TEST_F(DocShards, DamagedSidecarsAreErrorsNamingTheFile) {
  const Docs d = make_docs({4, 4}, 100);
  ShardSetWriter w(dir_, "train", 100, 1);
  for (size_t k = 0; k < 2; ++k) w.add_document(d.ids[k].data(), d.mask[k].data(), 4);
  w.finish();
  const fs::path shard = dir_ / "train_000000.bin";
  auto expect_error = [&](auto fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected " << needle;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { read_shard_mask(shard, 9); }, "train_000000.mask");                    // another shard's mask
  expect_error([&] { read_shard_docs(shard, 9); }, "train_000000.docs");
  fs::resize_file(shard_docs_path(shard), 1024 + 8);                                        // offsets cut short
  expect_error([&] { read_shard_docs(shard, 8); }, "2 documents");
  { std::ofstream(shard_mask_path(shard), std::ios::binary | std::ios::trunc) << "short"; }
  expect_error([&] { read_shard_mask(shard, 8); }, "too small");
  fs::remove(shard_docs_path(shard));
  expect_error([&] { read_shard_docs(shard, 8); }, "train_000000.docs");
}

}  // namespace
