// The sampling loop (see generate.h).
#include "src/infer/generate.h"

#include <algorithm>
#include <chrono>
#include <span>

namespace strata {

std::vector<GenResult> generate(Generator& gen, const std::vector<GenRequest>& requests, const SamplingParams& params,
                                const std::vector<int32_t>& eos_ids, const OnToken& on_token, GenTimes* times) {
  params.validate();
  const size_t B = requests.size();
  const auto V = static_cast<size_t>(gen.config().vocab_size);
  std::vector<GenResult> out(B);
  std::vector<SampleRng> rngs;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<bool> done(B, false);
  GenTimes t;
  for (size_t i = 0; i < B; ++i) {
    rngs.emplace_back(params.seed);
    prompts.push_back(requests[i].prompt);
    t.prompt_tokens += static_cast<int64_t>(requests[i].prompt.size());
    if (requests[i].max_new_tokens <= 0) done[i] = true, out[i].finish = "length";
  }
  using clock = std::chrono::steady_clock;
  auto ms_since = [](clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock::now() - t0).count();
  };
  auto t0 = clock::now();
  const std::vector<float>* logits = &gen.prefill(prompts);
  t.prefill_ms = ms_since(t0);
  t0 = clock::now();
  std::vector<std::pair<double, int32_t>> scratch;
  std::vector<int32_t> next(B, 0);
  while (true) {
    for (size_t i = 0; i < B; ++i) {
      if (done[i]) continue;
      const int32_t tok = sample_token(std::span<const float>(logits->data() + i * V, V), params, rngs[i], scratch);
      next[i] = tok;
      if (std::find(eos_ids.begin(), eos_ids.end(), tok) != eos_ids.end()) {
        done[i] = true, out[i].finish = "eos";
        continue;
      }
      out[i].ids.push_back(tok);
      ++t.new_tokens;
      if (on_token && !on_token(i, tok))
        done[i] = true, out[i].finish = "stop";
      else if (static_cast<int64_t>(out[i].ids.size()) >= requests[i].max_new_tokens)
        done[i] = true, out[i].finish = "length";
    }
    if (std::all_of(done.begin(), done.end(), [](bool d) { return d; })) break;
    logits = &gen.step(next);  // finished items ride along; their logits are not read
    ++t.decode_steps;
  }
  t.decode_ms = ms_since(t0);
  if (times) *times = t;
  return out;
}

}  // namespace strata
