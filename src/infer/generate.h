// The sampling loop over a Generator: prefill a batch of prompts, then sample one token per
// unfinished item per step until each reaches EOS, its token limit, or its caller says stop.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "src/infer/generator.h"
#include "src/infer/sampler.h"

namespace strata {

struct GenRequest {
  std::vector<int32_t> prompt;
  int64_t max_new_tokens = 0;
};

struct GenResult {
  std::vector<int32_t> ids;  // the new tokens (EOS not included)
  std::string finish;        // "eos" | "length" | "stop" (the caller's on_token said so)
};

struct GenTimes {
  double prefill_ms = 0, decode_ms = 0;
  int64_t prompt_tokens = 0;  // all prompts' tokens
  int64_t decode_steps = 0;   // steps after the prefill
  int64_t new_tokens = 0;     // all items' sampled tokens
};

// Called with (item, token) for each new token that is not EOS; return false to finish the item
// ("stop"), the token kept. May be empty.
using OnToken = std::function<bool(size_t item, int32_t token)>;

// Generates for every request at once (batched; requests.size() <= the generator's batch). Item
// i samples from its own SampleRng(params.seed), so it gets the tokens it would get alone.
std::vector<GenResult> generate(Generator& gen, const std::vector<GenRequest>& requests, const SamplingParams& params,
                                const std::vector<int32_t>& eos_ids, const OnToken& on_token = {},
                                GenTimes* times = nullptr);

}  // namespace strata
