// Rows from documents (src/data/doc_rows.h): one document per row (cut to T + 1 and padded) or
// packed first fit (long documents split into row-sized pieces), targets only inside a piece
// and only for trained tokens, positions restarting at each piece, segments, the global
// micro-batch split across ranks, the trained count over all ranks, a per-epoch shuffle that is
// a permutation and the same for the same seed, resuming from a position, epochs, and errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "src/data/doc_rows.h"
#include "src/data/doc_shards.h"

using namespace strata;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kVocab = 64;
uint32_t token(size_t d, int64_t i) { return static_cast<uint32_t>((d * 31 + static_cast<size_t>(i) * 7) % 50 + 1); }
bool trained(size_t d, int64_t i) { return (d + static_cast<size_t>(i)) % 3 != 0; }

class DocRows : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::path(::testing::TempDir()) / "strata_docrows_XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override { fs::remove_all(dir_); }
  // Shards of documents of these lengths (two shards: the writer splits at 20 tokens).
  std::vector<fs::path> write(const std::vector<int64_t>& lens, bool mask = true) {
    lens_ = lens;
    ShardSetWriter w(dir_, "train", 20, 1);
    for (size_t d = 0; d < lens.size(); ++d) {
      std::vector<uint32_t> ids;
      std::vector<uint8_t> m;
      for (int64_t i = 0; i < lens[d]; ++i) ids.push_back(token(d, i)), m.push_back(trained(d, i) ? 1 : 0);
      w.add_document(ids.data(), m.data(), ids.size());
    }
    std::vector<fs::path> out;
    for (const std::string& n : w.finish()) out.push_back(dir_ / n);
    if (!mask)
      for (const fs::path& p : out) fs::remove(shard_mask_path(p));
    return out;
  }
  fs::path dir_;
  std::vector<int64_t> lens_;
};

struct Piece {
  size_t doc;
  int64_t first, len;
};
struct Rows {
  std::vector<int32_t> in, tg, pos, seg;
  int64_t trained = 0;
};

// The rows the contract describes, from explicit pieces per row.
Rows expected(const std::vector<std::vector<Piece>>& rows, int64_t T, bool mask = true) {
  Rows r;
  for (const auto& row : rows) {
    int64_t s = 0;
    for (const Piece& p : row) {
      for (int64_t j = 0; j < p.len && s + j < T; ++j) {
        r.in.push_back(static_cast<int32_t>(token(p.doc, p.first + j)));
        const bool t = j + 1 < p.len && (!mask || trained(p.doc, p.first + j + 1));
        r.tg.push_back(t ? static_cast<int32_t>(token(p.doc, p.first + j + 1)) : -1);
        r.trained += t;
        r.pos.push_back(static_cast<int32_t>(j));
        r.seg.push_back(static_cast<int32_t>(s));
      }
      s += p.len;
    }
    for (; s < T; ++s) r.in.push_back(0), r.tg.push_back(-1), r.pos.push_back(0), r.seg.push_back(static_cast<int32_t>(s));
  }
  return r;
}

// n micro-batches from the loader, concatenated.
Rows take(DocRowLoader& l, const DocRowsOptions& o, int n) {
  Rows r;
  const size_t N = static_cast<size_t>(o.batch * o.seq);
  for (int k = 0; k < n; ++k) {
    std::vector<int32_t> in(N), tg(N), pos(N), seg(N);
    r.trained += l.next(RowBatch{in.data(), tg.data(), pos.data(), seg.data()});
    r.in.insert(r.in.end(), in.begin(), in.end());
    r.tg.insert(r.tg.end(), tg.begin(), tg.end());
    r.pos.insert(r.pos.end(), pos.begin(), pos.end());
    r.seg.insert(r.seg.end(), seg.begin(), seg.end());
  }
  return r;
}

void expect_rows(const Rows& got, const Rows& want) {
  EXPECT_EQ(got.in, want.in);
  EXPECT_EQ(got.tg, want.tg);
  EXPECT_EQ(got.pos, want.pos);
  EXPECT_EQ(got.seg, want.seg);
  EXPECT_EQ(got.trained, want.trained);
}

const std::vector<int64_t> kLens{3, 12, 5, 9, 2, 7};

TEST_F(DocRows, OneDocumentPerRowCutAndPadded) {
  const auto shards = write(kLens);
  ASSERT_GE(shards.size(), 2u);
  EXPECT_TRUE(shards_have_documents(shards));
  const DocRowsOptions o{2, 8, 0, 1, kVocab, false, false, 0, 0};
  DocRowLoader l(shards, o);
  EXPECT_EQ(l.n_documents(), 6);
  EXPECT_TRUE(l.has_mask());
  const Rows got = take(l, o, 3);
  expect_rows(got, expected({{{0, 0, 3}}, {{1, 0, 9}}, {{2, 0, 5}}, {{3, 0, 9}}, {{4, 0, 2}}, {{5, 0, 7}}}, 8));
  EXPECT_EQ(l.truncated_documents(), 1);
  EXPECT_EQ(l.truncated_tokens(), 3);
  // The next epoch starts again at document 0.
  EXPECT_EQ(l.position(), (DocPosition{1, 0, 0}));
}

TEST_F(DocRows, PackedFirstFitSplitsLongDocuments) {
  const auto shards = write(kLens);
  const DocRowsOptions o{1, 8, 0, 1, kVocab, true, false, 0, 0};
  DocRowLoader l(shards, o);
  // 9 slots a row: [0:3] | [1:0..9] | [1:9..12][2:5] | [3:9] | [4:2][5:7], then epoch 2.
  expect_rows(take(l, o, 6), expected({{{0, 0, 3}},
                                       {{1, 0, 9}},
                                       {{1, 9, 3}, {2, 0, 5}},
                                       {{3, 0, 9}},
                                       {{4, 0, 2}, {5, 0, 7}},
                                       {{0, 0, 3}}},
                                      8));
  EXPECT_EQ(l.rows_for_epochs(1), 5);
  EXPECT_EQ(l.rows_for_epochs(3), 15);
}

TEST_F(DocRows, WithoutAMaskEveryTargetInsideAPieceIsTrained) {
  const auto shards = write(kLens, /*mask=*/false);
  const DocRowsOptions o{5, 8, 0, 1, kVocab, true, false, 0, 0};
  DocRowLoader l(shards, o);
  EXPECT_FALSE(l.has_mask());
  expect_rows(take(l, o, 1), expected({{{0, 0, 3}}, {{1, 0, 9}}, {{1, 9, 3}, {2, 0, 5}}, {{3, 0, 9}}, {{4, 0, 2}, {5, 0, 7}}},
                                      8, /*mask=*/false));
}

// Rank r of a world takes rows [r·B, (r+1)·B) of each global micro-batch; every rank counts
// the trained targets of all of them.
TEST_F(DocRows, RanksSplitTheGlobalMicroBatch) {
  const auto shards = write(kLens);
  const DocRowsOptions one{4, 8, 0, 1, kVocab, true, true, 7, 0};
  DocRowLoader whole(shards, one);
  const Rows all = take(whole, one, 3);
  const size_t N = 2 * 8;
  for (int r = 0; r < 2; ++r) {
    DocRowsOptions o = one;
    o.batch = 2, o.rank = r, o.world = 2;
    DocRowLoader l(shards, o);
    const Rows mine = take(l, o, 3);
    EXPECT_EQ(mine.trained, all.trained);
    for (size_t k = 0; k < 3; ++k)
      for (size_t i = 0; i < N; ++i) {
        const size_t at = k * 2 * N + static_cast<size_t>(r) * N + i;
        ASSERT_EQ(mine.in[k * N + i], all.in[at]);
        ASSERT_EQ(mine.tg[k * N + i], all.tg[at]);
        ASSERT_EQ(mine.pos[k * N + i], all.pos[at]);
        ASSERT_EQ(mine.seg[k * N + i], all.seg[at]);
      }
  }
}

// Each epoch's order is a permutation of the documents, drawn from the seed: the same seed gives
// the same rows, another seed or the next epoch another order.
TEST_F(DocRows, ShuffleIsASeededPermutationPerEpoch) {
  std::vector<int64_t> lens;
  for (int d = 0; d < 40; ++d) lens.push_back(2 + d % 5);
  const auto shards = write(lens);
  const auto epoch_orders = [&](uint64_t seed) {
    DocRowsOptions o{40, 8, 0, 1, kVocab, false, true, seed, 0};
    DocRowLoader l(shards, o);
    const Rows r = take(l, o, 2);  // two epochs, one document per row
    std::vector<std::vector<uint32_t>> firsts(2);
    for (size_t row = 0; row < 80; ++row) firsts[row / 40].push_back(static_cast<uint32_t>(r.in[row * 8]));
    return firsts;
  };
  const auto a = epoch_orders(1), b = epoch_orders(1), c = epoch_orders(2);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a[0], a[1]);
  std::vector<uint32_t> want;
  for (size_t d = 0; d < 40; ++d) want.push_back(token(d, 0));
  std::sort(want.begin(), want.end());
  for (auto order : {a[0], a[1], c[0]}) {
    std::sort(order.begin(), order.end());
    EXPECT_EQ(order, want);
  }
}

// The position is the whole state: a loader seeked to it continues with the same rows.
TEST_F(DocRows, ResumesFromItsPosition) {
  const auto shards = write(kLens);
  const DocRowsOptions o{1, 6, 0, 1, kVocab, true, true, 11, 0};
  DocRowLoader a(shards, o);
  take(a, o, 7);
  const DocPosition p = a.position();
  EXPECT_GT(p.epoch, 0);
  const Rows rest = take(a, o, 9);
  DocRowLoader b(shards, o);
  b.seek(p);
  expect_rows(take(b, o, 9), rest);
  EXPECT_THROW(b.seek({0, 6, 0}), std::invalid_argument);
  EXPECT_THROW(b.seek({0, 0, -1}), std::invalid_argument);
}

// With epochs, every row after the last epoch is padding and trains nothing.
TEST_F(DocRows, EpochsEndInPadding) {
  const auto shards = write(kLens);
  const DocRowsOptions o{2, 8, 0, 1, kVocab, true, false, 0, 1};
  DocRowLoader l(shards, o);
  take(l, o, 2);
  EXPECT_FALSE(l.done());
  const Rows last = take(l, o, 1);  // row 5 of 5, then one padding row
  EXPECT_TRUE(l.done());
  expect_rows(last, expected({{{4, 0, 2}, {5, 0, 7}}, {}}, 8));
  const Rows after = take(l, o, 1);
  EXPECT_EQ(after.trained, 0);
  EXPECT_TRUE(std::all_of(after.tg.begin(), after.tg.end(), [](int32_t t) { return t == -1; }));
}

TEST_F(DocRows, ErrorsNameTheShard) {
  const auto shards = write(kLens);
  // A set where only some shards have document offsets.
  fs::remove(shard_docs_path(shards[1]));
  try {
    shards_have_documents(shards);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(shards[1].string()), std::string::npos) << e.what();
  }
  // A token beyond the model's vocabulary.
  try {
    DocRowLoader l({shards[0]}, DocRowsOptions{1, 8, 0, 1, 20, false, false, 0, 0});
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("vocab_size 20"), std::string::npos) << e.what();
  }
}

}  // namespace
