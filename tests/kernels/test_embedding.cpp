// Embedding lookup (plain and accumulating) and its scatter-add backward on the CPU backend:
// forward against a float64 gather, backward against float64 finite differences with repeated
// ids, determinism of the parallel scatter, and out-of-range ids as errors.
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

}  // namespace
