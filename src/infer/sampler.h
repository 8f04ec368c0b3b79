// Choosing the next token from a row of logits: greedy, or temperature → top-k → top-p (nucleus)
// sampling in Hugging Face's order, with fp64 softmax and a seeded RNG of our own, so the same
// seed gives the same tokens on any machine and thread count.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace strata {

struct SamplingParams {
  double temperature = 1.0;  // 0: greedy (argmax)
  int64_t top_k = 0;         // 0: off; 1 is greedy
  double top_p = 1.0;        // (0, 1]; 1: off
  uint64_t seed = 0;
  // Throws std::invalid_argument naming the flag (--temperature, --top-k, --top-p) when out of range.
  void validate() const;
  bool greedy() const { return temperature == 0.0 || top_k == 1; }
};

// splitmix64: a counter-based generator whose stream depends on the seed alone.
class SampleRng {
 public:
  explicit SampleRng(uint64_t seed) : state_(seed) {}
  uint64_t next_u64();
  double next_unit();  // uniform in [0, 1), 53 bits

 private:
  uint64_t state_;
};

// The index of the largest logit (the lowest index among equal ones).
int32_t argmax(std::span<const float> logits);

// One token from `logits` (V) under p: greedy, else temperature, then the top_k largest (ties by
// lower index), then the smallest prefix of those (by probability, descending) whose mass reaches
// top_p (at least one token), renormalised; one draw of rng picks from that distribution.
// `scratch` is reused between calls.
int32_t sample_token(std::span<const float> logits, const SamplingParams& p, SampleRng& rng,
                     std::vector<std::pair<double, int32_t>>& scratch);

}  // namespace strata
