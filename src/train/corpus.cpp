// The embedded corpus: sentences drawn from templates and word lists with a fixed-seed
// generator, so a small model has real structure to learn (grammar, agreement, simple sums).
#include "src/train/corpus.h"

#include <array>
#include <stdexcept>
#include <vector>

#include "src/data/token_shards.h"

namespace strata {
namespace {

struct Rng {
  uint64_t s;
  uint64_t next() {
    s += 0x9e3779b97f4a7c15ull;
    uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  template <class A> const char* pick(const A& a) { return a[next() % a.size()]; }
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }
};

constexpr std::array kNames{"Ada", "Bruno", "Chen", "Dalia", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun",
                            "Kira", "Lena", "Milo", "Nadia", "Oskar", "Priya", "Rosa", "Tomas"};
constexpr std::array kAdjs{"small", "quiet", "bright", "old", "green", "heavy", "narrow", "warm", "patient",
                           "curious", "broken", "golden", "steady", "careful", "distant", "gentle"};
constexpr std::array kNouns{"river", "lantern", "garden", "engine", "letter", "bridge", "kettle", "map",
                            "window", "orchard", "harbor", "notebook", "ladder", "clock", "meadow", "train"};
constexpr std::array kPlaces{"market", "station", "library", "village", "workshop", "valley", "kitchen",
                             "lighthouse", "school", "forest"};
constexpr std::array kVerbs{"carried", "found", "repaired", "painted", "followed", "opened", "watched",
                            "measured", "borrowed", "cleaned", "described", "remembered"};
constexpr std::array kTimes{"morning", "evening", "spring", "winter", "afternoon", "night"};
constexpr std::array kFeel{"happy", "tired", "surprised", "calm", "proud", "worried"};
constexpr std::array kNumbers{"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                              "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
                              "seventeen", "eighteen"};

std::string sentence(Rng& r) {
  const std::string n1 = r.pick(kNames), n2 = r.pick(kNames);
  switch (r.below(7)) {
    case 0:
      return "The " + std::string(r.pick(kAdjs)) + " " + r.pick(kNouns) + " was near the " + r.pick(kPlaces) + ".";
    case 1:
      return n1 + " " + r.pick(kVerbs) + " the " + r.pick(kAdjs) + " " + r.pick(kNouns) + " in the " +
             r.pick(kPlaces) + ".";
    case 2:
      return "In the " + std::string(r.pick(kTimes)) + ", " + n1 + " and " + n2 + " walked to the " +
             r.pick(kPlaces) + " and " + r.pick(kVerbs) + " a " + r.pick(kNouns) + ".";
    case 3: {
      const int a = r.below(10), b = r.below(9);
      return n1 + " counted " + kNumbers[a] + " and " + kNumbers[b] + " and said that makes " + kNumbers[a + b] + ".";
    }
    case 4:
      return n1 + " was " + std::string(r.pick(kFeel)) + " because " + n2 + " " + r.pick(kVerbs) + " the " +
             r.pick(kNouns) + ".";
    case 5:
      return "\"Where is the " + std::string(r.pick(kNouns)) + "?\" asked " + n1 + ". \"It is in the " +
             r.pick(kPlaces) + ",\" said " + n2 + ".";
    default:
      return "Every " + std::string(r.pick(kTimes)) + " the " + r.pick(kAdjs) + " " + r.pick(kNouns) +
             " stood by the " + r.pick(kPlaces) + ".";
  }
}

}  // namespace

std::string embedded_corpus_text(size_t bytes) {
  Rng r{20240520};
  std::string out;
  out.reserve(bytes + 256);
  while (out.size() < bytes) {
    const int n = 3 + r.below(4);
    for (int i = 0; i < n; ++i) {
      if (i) out += ' ';
      out += sentence(r);
    }
    out += "\n\n";
  }
  return out;
}

namespace {
// strata-corpus-<pid>-XXXXXX in the temp folder, after removing those of runs that were killed.
TempDir corpus_dir() {
  const std::filesystem::path tmp = std::filesystem::temp_directory_path();
  // Quietly: the temporary folder is shared by every strata run on the machine, so a notice
  // here would land in the stderr of unrelated runs (and break their one-line errors).
  remove_dead_pid_dirs(tmp, "strata-corpus-", /*report=*/false);
  return TempDir::create_owned(tmp / "strata-corpus", "-");
}
}  // namespace

// The directory is a member: if writing the shard throws, it is removed with the half-built object.
EmbeddedCorpusShard::EmbeddedCorpusShard()
    : dir_(corpus_dir()),
      path_(dir_.path() / "corpus_bytes.bin") {
  const std::string text = embedded_corpus_text();
  std::vector<uint32_t> tokens(text.begin(), text.end());
  for (uint32_t& t : tokens) t &= 0xffu;  // bytes (char may be signed)
  n_tokens_ = static_cast<int64_t>(tokens.size());
  write_token_shard(path_, tokens, 1);
}

}  // namespace strata
