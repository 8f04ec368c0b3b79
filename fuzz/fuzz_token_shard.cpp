// libFuzzer: the llm.c token-shard header (src/data/token_shards.cpp) on arbitrary file bytes:
// open validates magic, version and size (std::runtime_error otherwise); a shard that opens is
// read end to end and batched by the DataLoader.
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "src/data/token_shards.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  fuzz::MemFile f(data, size);
  std::unique_ptr<TokenShard> shard;
  try {
    shard = TokenShard::open(f.path());
  } catch (const std::runtime_error&) {
    return 0;
  }
  const int64_t n = shard->n_tokens();
  if (n < 0 || static_cast<uint64_t>(n) > size) std::abort();
  uint64_t sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += shard->token(i);
  (void)sum;
  // Batches of 1×2 from the one shard (needs 3 tokens), with the header's first byte as vocab.
  try {
    DataLoader loader({f.path()}, 1, 2, 0, 1, 1 + data[0] % 200);
    std::vector<int32_t> in(2), tgt(2);
    for (int k = 0; k < 3; ++k) loader.next(in.data(), tgt.data());
  } catch (const std::runtime_error&) {
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
