// The regexes of tokenizer.json (Oniguruma syntax, as the Rust library compiles them) run by PCRE2
// with UTF, UCP and JIT. The few escapes whose meaning differs between the two (\s, \w, \b, \h, \u)
// are rewritten to explicit classes; everything else is PCRE2-compatible as written.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::text::detail {

// Oniguruma (Ruby syntax) pattern -> PCRE2 pattern with the same meaning. Throws
// std::runtime_error for a construct it cannot rewrite (\S or \W inside a class).
std::string onig_to_pcre2(std::string_view pattern);

class Regex {
 public:
  // Compiles an Oniguruma pattern; throws std::runtime_error with PCRE2's message and offset.
  explicit Regex(std::string_view onig_pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends [start, end) of each match in text, in order, as onig's find_iter reports them (an
  // empty match right after the previous match is skipped). Text must be valid UTF-8. Thread-safe.
  void find_all(std::string_view text, std::vector<std::pair<uint32_t, uint32_t>>& out) const;
  // The first match at or after `from`: true and [*start, *end) when found.
  bool find_at(std::string_view text, size_t from, size_t* start, size_t* end) const;
  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8
  bool jit_ = false;
};

}  // namespace strata::text::detail
