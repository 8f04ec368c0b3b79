// Token shards and the DataLoader: v1/v7 shards read back, corrupt shards rejected naming the
// file, and llm.c's batching on synthetic position-valued data (token i has value i mod vocab):
// exact rows for one rank, N ranks × B == 1 rank × N·B (N = 2, 3, 4) across shard boundaries and
// wraparound, and a multi-rank resume from one rank's saved position.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "src/data/token_shards.h"

using namespace strata;
namespace fs = std::filesystem;

namespace {

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

class DataDir : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::path(::testing::TempDir()) / "strata_data_XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override { fs::remove_all(dir_); }

  void expect_open_error(const fs::path& p, std::initializer_list<const char*> needles) {
    try {
      TokenShard::open(p);
      ADD_FAILURE() << "no error for " << p;
    } catch (const std::runtime_error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
      for (const char* n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
    }
  }

  // Shards of the given sizes holding one position-valued stream: token at global index g is
  // g mod vocab. Returns their paths (named so that sorted order is creation order).
  std::vector<fs::path> make_stream(const std::vector<int64_t>& sizes, int64_t vocab, int version) {
    std::vector<fs::path> paths;
    int64_t g = 0;
    for (size_t k = 0; k < sizes.size(); ++k) {
      std::vector<uint32_t> toks(static_cast<size_t>(sizes[k]));
      for (auto& t : toks) t = static_cast<uint32_t>(g++ % vocab);
      fs::path p = dir_ / ("shard_" + std::to_string(k) + ".bin");
      write_token_shard(p, toks, version);
      paths.push_back(p);
    }
    return paths;
  }
  fs::path dir_;
};

// llm.c's dataloader, restated independently: each shard holds (ntok - 1) / (world·B·T)
// samples; sample s of the current shard starts at s·world·B·T (+ rank·B·T for the rank); after
// the last sample move to the next shard, after the last shard back to the first.
struct ReferenceLoader {
  std::vector<int64_t> sizes;   // tokens per shard
  std::vector<int64_t> starts;  // global index of each shard's first token
  int64_t B, T, rank, world;
  size_t shard = 0;
  int64_t sample = 0;
  // Global token indices of the inputs of the next batch (targets are each + 1).
  std::vector<int64_t> next() {
    const int64_t step = world * B * T;
    if (sample >= (sizes[shard] - 1) / step) {
      shard = (shard + 1) % sizes.size();
      sample = 0;
    }
    std::vector<int64_t> idx(static_cast<size_t>(B * T));
    for (int64_t i = 0; i < B * T; ++i) idx[static_cast<size_t>(i)] = starts[shard] + sample * step + rank * B * T + i;
    ++sample;
    return idx;
  }
};

ReferenceLoader reference(const std::vector<int64_t>& sizes, int64_t B, int64_t T, int rank, int world) {
  ReferenceLoader r{sizes, {}, B, T, rank, world};
  int64_t g = 0;
  for (int64_t s : sizes) {
    r.starts.push_back(g);
    g += s;
  }
  return r;
}

}  // namespace

TEST_F(DataDir, ShardsV1AndV7ReadBack) {
  std::vector<uint32_t> small = {0, 1, 65535, 50256, 7};
  write_token_shard(dir_ / "a.bin", small, 1);
  auto a = TokenShard::open(dir_ / "a.bin");
  ASSERT_EQ(a->n_tokens(), 5);
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(a->token(i), small[static_cast<size_t>(i)]);
  EXPECT_EQ(a->path(), dir_ / "a.bin");
  EXPECT_EQ(fs::file_size(dir_ / "a.bin"), 1024u + 5 * 2);
  std::string bytes = read_file(dir_ / "a.bin");
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof(header));
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], 5);

  std::vector<uint32_t> big = {0, 128255, 70000, 4294967295u};
  write_token_shard(dir_ / "b.bin", big, 7);
  auto b = TokenShard::open(dir_ / "b.bin");
  ASSERT_EQ(b->n_tokens(), 4);
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(b->token(i), big[static_cast<size_t>(i)]);
  EXPECT_EQ(fs::file_size(dir_ / "b.bin"), 1024u + 4 * 4);
  bytes = read_file(dir_ / "b.bin");
  std::memcpy(header, bytes.data(), sizeof(header));
  EXPECT_EQ(header[0], 20240801);
  EXPECT_EQ(header[1], 7);

  write_token_shard(dir_ / "empty.bin", {}, 7);
  EXPECT_EQ(TokenShard::open(dir_ / "empty.bin")->n_tokens(), 0);
  EXPECT_THROW(write_token_shard(dir_ / "c.bin", {70000}, 1), std::invalid_argument);
  EXPECT_THROW(write_token_shard(dir_ / "c.bin", {1}, 2), std::invalid_argument);
}

TEST_F(DataDir, CorruptShardsNameTheFile) {
  write_token_shard(dir_ / "good.bin", {1, 2, 3, 4}, 1);
  const std::string good = read_file(dir_ / "good.bin");
  auto with_int = [&](int index, int32_t v) {
    std::string s = good;
    std::memcpy(s.data() + 4 * index, &v, 4);
    return s;
  };
  write_file(dir_ / "magic.bin", with_int(0, 12345));
  expect_open_error(dir_ / "magic.bin", {"magic", "12345", "20240520"});
  write_file(dir_ / "version.bin", with_int(1, 7));
  expect_open_error(dir_ / "version.bin", {"version 1", "version 7"});
  write_file(dir_ / "v7magic_v1.bin", with_int(0, 20240801));
  expect_open_error(dir_ / "v7magic_v1.bin", {"version 7", "version 1"});
  write_file(dir_ / "long.bin", good + "xx");
  expect_open_error(dir_ / "long.bin", {"4 tokens", "1032", "1034"});
  write_file(dir_ / "short.bin", good.substr(0, good.size() - 1));
  expect_open_error(dir_ / "short.bin", {"1032", "1031"});
  write_file(dir_ / "count.bin", with_int(2, 5));
  expect_open_error(dir_ / "count.bin", {"5 tokens", "1034", "1032"});
  write_file(dir_ / "negative.bin", with_int(2, -1));
  expect_open_error(dir_ / "negative.bin", {"negative"});
  write_file(dir_ / "tiny.bin", good.substr(0, 100));
  expect_open_error(dir_ / "tiny.bin", {"header"});
  expect_open_error(dir_ / "missing.bin", {"cannot open"});
}

TEST_F(DataDir, GlobIsSortedAndEmptyMatchNamesPattern) {
  for (const char* n : {"train_002.bin", "train_000.bin", "train_010.bin", "train_001.bin", "val_000.bin"})
    write_token_shard(dir_ / n, {1}, 1);
  auto paths = expand_glob((dir_ / "train_*.bin").string());
  ASSERT_EQ(paths.size(), 4u);
  EXPECT_EQ(paths[0].filename(), "train_000.bin");
  EXPECT_EQ(paths[1].filename(), "train_001.bin");
  EXPECT_EQ(paths[2].filename(), "train_002.bin");
  EXPECT_EQ(paths[3].filename(), "train_010.bin");
  const std::string pattern = (dir_ / "nothing_*.bin").string();
  try {
    expand_glob(pattern);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(pattern), std::string::npos) << e.what();
  }
}

TEST_F(DataDir, OneRankReadsLlmcRowsExactly) {
  const int64_t vocab = 50;  // smaller than the stream, so values wrap (i mod vocab)
  const std::vector<int64_t> sizes = {40, 33, 57};
  auto paths = make_stream(sizes, vocab, 1);
  const int64_t B = 2, T = 4;
  DataLoader dl(paths, B, T, 0, 1, vocab);
  EXPECT_EQ(dl.tokens_per_step(), 8);
  std::vector<int32_t> in(B * T), tg(B * T);

  // Hand-checked first batch: inputs 0..7, targets 1..8.
  dl.next(in.data(), tg.data());
  EXPECT_EQ(in, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(tg, (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  // Shard 0 (40 tokens) holds (40-1)/8 = 4 windows; the 5th batch is the first of shard 1,
  // whose global indices start at 40.
  for (int s = 1; s < 4; ++s) dl.next(in.data(), tg.data());
  EXPECT_EQ(in[0], 24);
  EXPECT_EQ(tg[7], 32);
  dl.next(in.data(), tg.data());
  EXPECT_EQ(dl.shard_index(), 1);
  EXPECT_EQ(in, (std::vector<int32_t>{40, 41, 42, 43, 44, 45, 46, 47}));
  EXPECT_EQ(tg, (std::vector<int32_t>{41, 42, 43, 44, 45, 46, 47, 48}));

  // Against the reference over several epochs (shard boundaries and wraparound).
  dl.reset();
  ReferenceLoader ref = reference(sizes, B, T, 0, 1);
  bool wrapped = false;
  for (int step = 0; step < 60; ++step) {
    dl.next(in.data(), tg.data());
    auto idx = ref.next();
    for (size_t i = 0; i < idx.size(); ++i) {
      ASSERT_EQ(in[i], idx[i] % vocab) << "step " << step << " i " << i;
      ASSERT_EQ(tg[i], (idx[i] + 1) % vocab) << "step " << step << " i " << i;
    }
    EXPECT_EQ(dl.shard_index(), static_cast<int64_t>(ref.shard));
    if (step > 0 && ref.shard == 0 && ref.sample == 1) wrapped = true;
  }
  EXPECT_TRUE(wrapped);
}

TEST_F(DataDir, TwoRanksSeeTheRowsOfOneRankWithDoubleBatch) {
  const int64_t vocab = 1000;
  const std::vector<int64_t> sizes = {101, 64, 130};
  auto paths = make_stream(sizes, vocab, 7);
  const int64_t B = 2, T = 3;
  DataLoader one(paths, 2 * B, T, 0, 1, vocab);
  DataLoader r0(paths, B, T, 0, 2, vocab);
  DataLoader r1(paths, B, T, 1, 2, vocab);
  ReferenceLoader ref = reference(sizes, B, T, 1, 2);
  std::vector<int32_t> in1(2 * B * T), tg1(2 * B * T), in_a(B * T), tg_a(B * T), in_b(B * T), tg_b(B * T);
  std::set<int64_t> shards_seen;
  int wraps = 0;
  for (int step = 0; step < 40; ++step) {
    one.next(in1.data(), tg1.data());
    r0.next(in_a.data(), tg_a.data());
    r1.next(in_b.data(), tg_b.data());
    std::vector<int32_t> in_cat(in_a), tg_cat(tg_a);
    in_cat.insert(in_cat.end(), in_b.begin(), in_b.end());
    tg_cat.insert(tg_cat.end(), tg_b.begin(), tg_b.end());
    ASSERT_EQ(in_cat, in1) << "step " << step;
    ASSERT_EQ(tg_cat, tg1) << "step " << step;
    auto idx = ref.next();  // rank 1's rows, independently
    for (size_t i = 0; i < idx.size(); ++i) ASSERT_EQ(in_b[i], idx[i] % vocab) << "step " << step;
    EXPECT_EQ(r0.shard_index(), one.shard_index());
    EXPECT_EQ(r1.position(), one.position());
    if (!shards_seen.empty() && one.shard_index() == 0 && *shards_seen.rbegin() == 2 &&
        one.position() == one.tokens_per_step())
      ++wraps;
    shards_seen.insert(one.shard_index());
  }
  EXPECT_EQ(shards_seen.size(), 3u);
  EXPECT_GE(wraps, 1);
}

// The same for 3 and 4 ranks, and the resume a multi-rank run needs: every rank's loader is at
// the same (shard, position) after each step (the window is global), so the position one rank
// saves in a checkpoint puts a fresh loader of any rank back on its own rows.
TEST_F(DataDir, NRanksSeeTheRowsOfOneRankWithNTimesTheBatchAndResumeTogether) {
  const int64_t vocab = 4096;
  const std::vector<int64_t> sizes = {250, 97, 400};
  auto paths = make_stream(sizes, vocab, 7);
  const int64_t B = 2, T = 4;
  for (int world : {3, 4}) {
    DataLoader one(paths, world * B, T, 0, 1, vocab);
    std::vector<std::unique_ptr<DataLoader>> ranks;
    for (int r = 0; r < world; ++r) ranks.push_back(std::make_unique<DataLoader>(paths, B, T, r, world, vocab));
    std::vector<int32_t> in1(world * B * T), tg1(world * B * T), in(B * T), tg(B * T);
    int64_t saved_shard = -1, saved_pos = -1;
    std::vector<std::vector<int32_t>> after_save(world);  // each rank's rows of the step after the save
    for (int step = 0; step < 30; ++step) {
      one.next(in1.data(), tg1.data());
      for (int r = 0; r < world; ++r) {
        ranks[r]->next(in.data(), tg.data());
        for (int64_t i = 0; i < B * T; ++i) {
          ASSERT_EQ(in[i], in1[r * B * T + i]) << "world " << world << " rank " << r << " step " << step;
          ASSERT_EQ(tg[i], tg1[r * B * T + i]) << "world " << world << " rank " << r << " step " << step;
        }
        EXPECT_EQ(ranks[r]->shard_index(), one.shard_index());
        EXPECT_EQ(ranks[r]->position(), one.position());
        if (step == 11) after_save[r] = in;
      }
      if (step == 10) saved_shard = ranks[0]->shard_index(), saved_pos = ranks[0]->position();
    }
    for (int r = 0; r < world; ++r) {
      DataLoader resumed(paths, B, T, r, world, vocab);
      resumed.seek(saved_shard, saved_pos);
      resumed.next(in.data(), tg.data());
      EXPECT_EQ(in, after_save[r]) << "world " << world << " rank " << r;
    }
  }
}

TEST_F(DataDir, SeekResumesTheSameBatches) {
  const int64_t vocab = 97;
  auto paths = make_stream({50, 70}, vocab, 1);
  DataLoader dl(paths, 1, 5, 0, 1, vocab);
  std::vector<int32_t> in(5), tg(5);
  for (int i = 0; i < 11; ++i) dl.next(in.data(), tg.data());
  const int64_t shard = dl.shard_index(), pos = dl.position();
  std::vector<std::vector<int32_t>> expected;
  for (int i = 0; i < 20; ++i) {
    dl.next(in.data(), tg.data());
    expected.push_back(in);
  }
  DataLoader resumed(paths, 1, 5, 0, 1, vocab);
  resumed.seek(shard, pos);
  for (int i = 0; i < 20; ++i) {
    resumed.next(in.data(), tg.data());
    EXPECT_EQ(in, expected[static_cast<size_t>(i)]) << i;
  }
  EXPECT_THROW(resumed.seek(2, 0), std::invalid_argument);
  EXPECT_THROW(resumed.seek(0, 51), std::invalid_argument);
  resumed.reset();
  resumed.next(in.data(), tg.data());
  EXPECT_EQ(in, (std::vector<int32_t>{0, 1, 2, 3, 4}));
}

// Token ids are checked once, when the loader opens the shards (one pass over each), not when
// a batch reaches them hours into a run: the error names the shard, the position, the byte
// offset and the id.
TEST_F(DataDir, TokenOutsideVocabNamesShardAndPosition) {
  std::vector<uint32_t> toks(40);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<uint32_t>(i % 10);
  write_token_shard(dir_ / "a.bin", toks, 1);  // clean
  toks[37] = 12;  // past every window a short run would read
  for (int version : {1, 7}) {
    write_token_shard(dir_ / "b.bin", toks, version);
    try {
      DataLoader dl({dir_ / "a.bin", dir_ / "b.bin"}, 2, 4, 0, 1, 10);
      FAIL() << "version " << version;
    } catch (const std::runtime_error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find((dir_ / "b.bin").string()), std::string::npos) << msg;
      EXPECT_NE(msg.find("token 12"), std::string::npos) << msg;
      EXPECT_NE(msg.find("position 37"), std::string::npos) << msg;
      EXPECT_NE(msg.find("byte offset " + std::to_string(1024 + 37 * (version == 1 ? 2 : 4))), std::string::npos)
          << msg;
      EXPECT_NE(msg.find("vocab_size 10"), std::string::npos) << msg;
    }
  }
  EXPECT_NO_THROW(DataLoader({dir_ / "a.bin"}, 2, 4, 0, 1, 10));
  EXPECT_NO_THROW(DataLoader({dir_ / "b.bin"}, 2, 4, 0, 1, 13));
}

TEST_F(DataDir, ShardSmallerThanAWindowIsAnError) {
  auto paths = make_stream({30, 8}, 100, 1);
  try {
    DataLoader dl(paths, 2, 4, 0, 1, 100);  // needs 9 tokens per window; shard_1 has 8
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(paths[1].string()), std::string::npos) << e.what();
  }
  EXPECT_THROW(DataLoader({}, 1, 1, 0, 1, 10), std::invalid_argument);
  EXPECT_THROW(DataLoader(paths, 1, 1, 2, 2, 10), std::invalid_argument);
  EXPECT_THROW(DataLoader(paths, 0, 1, 0, 1, 10), std::invalid_argument);
}

namespace strata {
namespace {

// A shard truncated (or rewritten shorter) under a running loader: the next read is an error
// naming the shard, never a SIGBUS from a mapped page past the new end.
TEST_F(DataDir, AShardThatShrinksUnderTheLoaderIsAnErrorNamingIt) {
  for (int version : {1, 7}) {
    const fs::path p = dir_ / ("shrinks" + std::to_string(version) + ".bin");
    std::vector<uint32_t> tokens(4096);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i % 256);
    write_token_shard(p, tokens, version);
    DataLoader loader({p}, 2, 16, 0, 1, 256);
    std::vector<int32_t> in(32), tgt(32);
    loader.next(in.data(), tgt.data());
    EXPECT_EQ(in[1], 1);
    EXPECT_EQ(tgt[0], 1);
    ASSERT_EQ(::truncate(p.c_str(), 1024 + 40), 0);
    try {
      for (int i = 0; i < 4; ++i) loader.next(in.data(), tgt.data());
      ADD_FAILURE() << "no error after the shard shrank";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(p.string() + ": the token shard shrank"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace strata
