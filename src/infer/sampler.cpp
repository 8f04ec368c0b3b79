// Token sampling (see sampler.h): the candidate list is sorted once by logit, so top-k is a
// prefix and top-p a shorter prefix of it; probabilities are fp64.
#include "src/infer/sampler.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace strata {

void SamplingParams::validate() const {
  if (!(temperature >= 0.0) || !std::isfinite(temperature))
    throw std::invalid_argument("--temperature " + std::to_string(temperature) + ": must be >= 0 (0 = greedy)");
  if (top_k < 0) throw std::invalid_argument("--top-k " + std::to_string(top_k) + ": must be >= 0 (0 = off)");
  if (!(top_p > 0.0 && top_p <= 1.0))
    throw std::invalid_argument("--top-p " + std::to_string(top_p) + ": must be in (0, 1] (1 = off)");
}

uint64_t SampleRng::next_u64() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

double SampleRng::next_unit() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

int32_t argmax(std::span<const float> logits) {
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = i;
  return static_cast<int32_t>(best);
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& p, SampleRng& rng,
                     std::vector<std::pair<double, int32_t>>& cand) {
  if (p.greedy()) return argmax(logits);
  const auto V = static_cast<int64_t>(logits.size());
  cand.resize(logits.size());
  for (int64_t i = 0; i < V; ++i)
    cand[static_cast<size_t>(i)] = {static_cast<double>(logits[static_cast<size_t>(i)]) / p.temperature,
                                    static_cast<int32_t>(i)};
  // Descending by scaled logit, ties by lower index: a total order, so the result is unique.
  auto before = [](const std::pair<double, int32_t>& a, const std::pair<double, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  const int64_t k = p.top_k > 0 ? std::min(p.top_k, V) : V;
  std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), before);
  cand.resize(static_cast<size_t>(k));
  // Softmax over the kept candidates (fp64), in place.
  const double mx = cand.front().first;
  double sum = 0;
  for (auto& c : cand) sum += (c.first = std::exp(c.first - mx));
  for (auto& c : cand) c.first /= sum;
  // Top-p: the shortest prefix whose mass reaches top_p (HF keeps the token that crosses it).
  if (p.top_p < 1.0) {
    double mass = 0;
    size_t keep = 0;
    while (keep < cand.size() && mass < p.top_p) mass += cand[keep++].first;
    cand.resize(std::max<size_t>(keep, 1));
  }
  double total = 0;
  for (const auto& c : cand) total += c.first;
  const double u = rng.next_unit() * total;
  double acc = 0;
  for (const auto& c : cand)
    if ((acc += c.first) > u) return c.second;
  return cand.back().second;
}

}  // namespace strata
