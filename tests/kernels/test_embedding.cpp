// Embedding lookup (plain and accumulating) and its scatter-add backward on the CPU backend:
// forward against a float64 gather, backward against float64 finite differences with repeated
// ids, determinism of the parallel scatter, and out-of-range ids as errors. A table split into
// two vocabulary shards gives the unsharded lookup and gradient bit for bit.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/runtime.h"
#include "layer_test_util.h"

using namespace strata::kernels;
using namespace strata::kernels::test;

namespace {

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % vocab);
  return ids;
}

class EmbeddingTest : public DtypeIsaTest {};

TEST_P(EmbeddingTest, ForwardGathersAndAccumulatesPositions) {
  const DType t = dtype();
  const double rtol = t == DType::f32 ? 1e-7 : (t == DType::bf16 ? 8e-3 : 1e-3);
  uint32_t seed = 1;
  for (int64_t dim : {1, 3, 17, 129}) {
    const int64_t vocab = 50, n_tokens = 37;
    const auto ids = random_ids(n_tokens, vocab, seed++);
    TypedBuf table(t, random_vec(vocab * dim, seed++)), pos(t, random_vec(n_tokens * dim, seed++));
    const auto tv = table.values(), pv = pos.values();
    TypedBuf out(t, random_vec(n_tokens * dim, seed++));
    std::vector<double> want(n_tokens * dim);
    for (int64_t i = 0; i < n_tokens; ++i)
      for (int64_t c = 0; c < dim; ++c) want[i * dim + c] = tv[ids[i] * dim + c];
    cpu::embedding({.dtype = t, .n_tokens = n_tokens, .dim = dim, .vocab = vocab, .ids = ids.data(),
                    .table = table.data(), .out = out.data()});
    expect_close(out.values(), want, 0, 0, "embedding dim " + std::to_string(dim));  // a copy: exact

    // Position embeddings: out += wpe[t] via ids 0..n_tokens-1 into the position table.
    std::vector<int32_t> positions(n_tokens);
    for (int64_t i = 0; i < n_tokens; ++i) positions[i] = static_cast<int32_t>(i);
    cpu::embedding({.dtype = t, .n_tokens = n_tokens, .dim = dim, .vocab = n_tokens, .ids = positions.data(),
                    .table = pos.data(), .out = out.data(), .accumulate = true});
    for (int64_t i = 0; i < n_tokens * dim; ++i) want[i] += pv[i];
    expect_close(out.values(), want, 1e-7, rtol, "embedding accumulate dim " + std::to_string(dim));
  }
}

TEST_P(EmbeddingTest, BackwardScatterAddsFiniteDifferenceGradient) {
  const DType t = dtype();
  uint32_t seed = 20;
  for (int64_t dim : {1, 3, 17, 129}) {
    const int64_t vocab = 11, n_tokens = 40;  // many repeats per id
    const auto ids = random_ids(n_tokens, vocab, seed++);
    TypedBuf w(t, random_vec(n_tokens * dim, seed++));
    const auto wv = w.values();
    auto loss = [&](const std::vector<double>& table) {  // L = Σ w·table[ids]
      double l = 0;
      for (int64_t i = 0; i < n_tokens; ++i)
        for (int64_t c = 0; c < dim; ++c) l += wv[i * dim + c] * table[ids[i] * dim + c];
      return l;
    };
    const auto fd = finite_diff(random_vec(vocab * dim, seed++), loss);
    const auto init = random_vec(vocab * dim, seed++);
    std::vector<float> dtable(init.begin(), init.end());
    cpu::embedding_backward({.dtype = t, .n_tokens = n_tokens, .dim = dim, .vocab = vocab, .ids = ids.data(),
                             .dout = w.data(), .dtable = dtable.data()});
    std::vector<double> want(vocab * dim);
    for (size_t i = 0; i < want.size(); ++i) want[i] = static_cast<float>(init[i]) + fd[i];
    expect_close(std::vector<double>(dtable.begin(), dtable.end()), want, 1e-5, 1e-6,
                 "embedding_backward dim " + std::to_string(dim));
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, EmbeddingTest, dtype_isa_values(), dtype_isa_name);

TEST(EmbeddingOps, BackwardIsDeterministicOverManyTokens) {
  const int64_t vocab = 40, dim = 300, n_tokens = 2000;
  const auto ids = random_ids(n_tokens, vocab, 5);
  const auto dout = random_vec(n_tokens * dim, 6);
  std::vector<float> df(dout.begin(), dout.end());
  std::vector<float> a(vocab * dim, 0.f), b(vocab * dim, 0.f);
  for (auto [d, threads] : {std::pair{&a, 1}, std::pair{&b, 3}})  // same bits for any partition
    with_threads(threads, [&] {
      cpu::embedding_backward({.n_tokens = n_tokens, .dim = dim, .vocab = vocab, .ids = ids.data(),
                               .dout = df.data(), .dtable = d->data()});
    });
  EXPECT_EQ(a, b);
  std::vector<double> want(vocab * dim, 0.0);
  for (int64_t i = 0; i < n_tokens; ++i)
    for (int64_t c = 0; c < dim; ++c) want[ids[i] * dim + c] += df[i * dim + c];
  expect_close(std::vector<double>(a.begin(), a.end()), want, 1e-4, 1e-5, "dtable");
}

TEST(EmbeddingOps, OutOfRangeIdIsAnErrorNamingTokenAndId) {
  const int64_t vocab = 10, dim = 4;
  std::vector<float> table(vocab * dim, 1.f), out(3 * dim, 0.f), dtable(vocab * dim, 0.f);
  for (int32_t bad : {10, -1, 1 << 30}) {
    const std::vector<int32_t> ids = {1, 2, bad};
    try {
      cpu::embedding({.n_tokens = 3, .dim = dim, .vocab = vocab, .ids = ids.data(), .table = table.data(),
                      .out = out.data()});
      ADD_FAILURE() << "id " << bad << " accepted";
    } catch (const std::out_of_range& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("token 2"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
    }
    EXPECT_THROW(cpu::embedding_backward({.n_tokens = 3, .dim = dim, .vocab = vocab, .ids = ids.data(),
                                          .dout = out.data(), .dtable = dtable.data()}),
                 std::out_of_range);
  }
  for (float v : out) EXPECT_EQ(v, 0.f) << "nothing written before the id check";
  for (float v : dtable) EXPECT_EQ(v, 0.f);

  // Through the Ops interface the error surfaces at the stream's synchronize().
  auto rt = make_runtime(Backend::cpu);
  auto stream = rt->create_stream();
  const std::vector<int32_t> ids = {3, 99};
  rt->ops().embedding(*stream, {.n_tokens = 2, .dim = dim, .vocab = vocab, .ids = ids.data(), .table = table.data(),
                                .out = out.data()});
  EXPECT_THROW(stream->synchronize(), std::out_of_range);
  EXPECT_THROW(rt->ops().embedding(*stream, {.n_tokens = 2, .dim = dim, .vocab = vocab, .ids = nullptr,
                                             .table = table.data(), .out = out.data()}),
               std::invalid_argument);
}

// ---- vocabulary-sharded table -------------------------------------------------------------------

// Rows [row0, row0 + n) of a (vocab, dim) table.
TypedBuf rows_of(const std::vector<double>& table, int64_t dim, int64_t row0, int64_t n, DType t) {
  return TypedBuf(t, std::vector<double>(table.begin() + row0 * dim, table.begin() + (row0 + n) * dim));
}

TEST_P(EmbeddingTest, TwoShardsSumToTheWholeLookup) {
  const DType t = dtype();
  const int64_t full_vocab = 50, split = 20, dim = 17, n_tokens = 37;
  const auto ids = random_ids(n_tokens, full_vocab, 40);
  const TypedBuf table(t, random_vec(full_vocab * dim, 41));
  const auto tv = table.values();
  const int64_t row0s[2] = {0, split}, vocabs[2] = {split, full_vocab - split};
  const TypedBuf shards[2] = {rows_of(tv, dim, 0, split, t), rows_of(tv, dim, split, full_vocab - split, t)};

  TypedBuf whole(t, n_tokens * dim);
  cpu::embedding({.dtype = t, .n_tokens = n_tokens, .dim = dim, .vocab = full_vocab, .ids = ids.data(),
                  .table = table.data(), .out = whole.data()});
  std::vector<double> sum(n_tokens * dim, 0.0);
  for (int s = 0; s < 2; ++s) {
    TypedBuf out(t, random_vec(n_tokens * dim, 42 + s));  // every row overwritten: its own, or zeros
    cpu::embedding({.dtype = t, .n_tokens = n_tokens, .dim = dim, .vocab = vocabs[s], .ids = ids.data(),
                    .table = shards[s].data(), .out = out.data(), .row0 = row0s[s], .full_vocab = full_vocab});
    const auto ov = out.values();
    for (int64_t i = 0; i < n_tokens; ++i) {
      const bool here = ids[i] >= row0s[s] && ids[i] < row0s[s] + vocabs[s];
      for (int64_t c = 0; c < dim; ++c) {
        if (!here) {
          ASSERT_EQ(ov[i * dim + c], 0.0) << "shard " << s << " token " << i;
        }
        sum[i * dim + c] += ov[i * dim + c];
      }
    }
  }
  expect_close(sum, whole.values(), 0, 0, "sum of the shards' lookups");

  // Accumulating: each shard adds its tokens' rows and leaves the others as they were, so the
  // two in turn are the unsharded accumulate.
  const auto base = random_vec(n_tokens * dim, 44);
  TypedBuf whole_acc(t, base), sharded_acc(t, base);
  cpu::embedding({.dtype = t, .n_tokens = n_tokens, .dim = dim, .vocab = full_vocab, .ids = ids.data(),
                  .table = table.data(), .out = whole_acc.data(), .accumulate = true});
  for (int s = 0; s < 2; ++s) {
    cpu::embedding({.dtype = t, .n_tokens = n_tokens, .dim = dim, .vocab = vocabs[s], .ids = ids.data(),
                    .table = shards[s].data(), .out = sharded_acc.data(), .accumulate = true, .row0 = row0s[s],
                    .full_vocab = full_vocab});
  }
  expect_close(sharded_acc.values(), whole_acc.values(), 0, 0, "shards accumulating in turn");
}

TEST_P(EmbeddingTest, ShardBackwardIsItsRowsOfTheWholeBackward) {
  const DType t = dtype();
  const int64_t full_vocab = 11, split = 4, dim = 129, n_tokens = 40;  // many repeats per id
  const auto ids = random_ids(n_tokens, full_vocab, 50);
  const TypedBuf dout(t, random_vec(n_tokens * dim, 51));
  const auto init = random_vec(full_vocab * dim, 52);
  std::vector<float> whole(init.begin(), init.end());
  cpu::embedding_backward({.dtype = t, .n_tokens = n_tokens, .dim = dim, .vocab = full_vocab, .ids = ids.data(),
                           .dout = dout.data(), .dtable = whole.data()});
  const int64_t row0s[2] = {0, split}, vocabs[2] = {split, full_vocab - split};
  for (int s = 0; s < 2; ++s) {
    std::vector<float> dtable(init.begin() + row0s[s] * dim, init.begin() + (row0s[s] + vocabs[s]) * dim);
    cpu::embedding_backward({.dtype = t, .n_tokens = n_tokens, .dim = dim, .vocab = vocabs[s], .ids = ids.data(),
                             .dout = dout.data(), .dtable = dtable.data(), .row0 = row0s[s],
                             .full_vocab = full_vocab});
    const std::vector<float> want(whole.begin() + row0s[s] * dim, whole.begin() + (row0s[s] + vocabs[s]) * dim);
    EXPECT_EQ(dtable, want) << "shard " << s;
  }
}

TEST(EmbeddingOps, ShardedIdsAndRow0AreChecked) {
  const int64_t full_vocab = 10, row0 = 6, vocab = 4, dim = 4;
  std::vector<float> table(vocab * dim, 1.f), out(3 * dim, 0.f), dtable(vocab * dim, 0.f);
  // An id of another shard is fine; one outside [0, full_vocab) is an error naming full_vocab.
  const std::vector<int32_t> ok = {0, 5, 9};
  cpu::embedding({.n_tokens = 3, .dim = dim, .vocab = vocab, .ids = ok.data(), .table = table.data(),
                  .out = out.data(), .row0 = row0, .full_vocab = full_vocab});
  for (int32_t bad : {10, -1}) {
    const std::vector<int32_t> ids = {1, 7, bad};
    try {
      cpu::embedding({.n_tokens = 3, .dim = dim, .vocab = vocab, .ids = ids.data(), .table = table.data(),
                      .out = out.data(), .row0 = row0, .full_vocab = full_vocab});
      ADD_FAILURE() << "id " << bad << " accepted";
    } catch (const std::out_of_range& e) {
      EXPECT_NE(std::string(e.what()).find("outside [0, 10)"), std::string::npos) << e.what();
    }
    EXPECT_THROW(cpu::embedding_backward({.n_tokens = 3, .dim = dim, .vocab = vocab, .ids = ids.data(),
                                          .dout = out.data(), .dtable = dtable.data(), .row0 = row0,
                                          .full_vocab = full_vocab}),
                 std::out_of_range);
  }
  for (float v : dtable) EXPECT_EQ(v, 0.f);

  // The shard must lie inside the full table, and row0 means nothing without full_vocab.
  auto rt = make_runtime(Backend::cpu);
  auto stream = rt->create_stream();
  const EmbeddingArgs fwd{.n_tokens = 3, .dim = dim, .vocab = vocab, .ids = ok.data(), .table = table.data(),
                          .out = out.data(), .row0 = row0, .full_vocab = full_vocab};
  const EmbeddingBackwardArgs bwd{.n_tokens = 3, .dim = dim, .vocab = vocab, .ids = ok.data(), .dout = out.data(),
                                  .dtable = dtable.data(), .row0 = row0, .full_vocab = full_vocab};
  rt->ops().embedding(*stream, fwd);
  rt->ops().embedding_backward(*stream, bwd);
  stream->synchronize();
  for (auto [r0, fv] : {std::pair<int64_t, int64_t>{-1, 10}, {7, 10}, {3, 0}, {0, -5}}) {
    auto f = fwd;
    f.row0 = r0, f.full_vocab = fv;
    auto b = bwd;
    b.row0 = r0, b.full_vocab = fv;
    const char* field = fv < 0 ? "full_vocab" : "row0";
    try {
      rt->ops().embedding(*stream, f);
      ADD_FAILURE() << "row0 " << r0 << " full_vocab " << fv << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
    EXPECT_THROW(rt->ops().embedding_backward(*stream, b), std::invalid_argument);
  }
}

}  // namespace
