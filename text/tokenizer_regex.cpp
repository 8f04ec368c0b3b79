// PCRE2 behind tokenizer.json's Oniguruma patterns: the syntax rewrite, JIT compilation and a
// per-thread match context (match data and JIT stack) so that one compiled Regex serves all threads.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "text/tokenizer_regex.h"

#include <pcre2.h>

#include <stdexcept>

#include "text/tokenizer_unicode.h"

namespace strata::text::detail {

namespace {

// Oniguruma's Unicode \s is the White_Space property; PCRE2's (UCP) adds U+180E.
constexpr const char* kSpaceSet =
    "\\t-\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";
// Oniguruma's Unicode \w: Alphabetic, Mark, Decimal_Number, Connector_Punctuation, Join_Control.
constexpr const char* kWordSet = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}";
constexpr const char* kHexSet = "0-9a-fA-F";

bool is_hex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

}  // namespace

std::string onig_to_pcre2(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 32);
  int class_depth = 0;  // Oniguruma allows nested classes; PCRE2 does not, so we only track them
  bool class_start = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      const bool in_class = class_depth > 0;
      auto set = [&](const char* members, bool negate) {
        if (in_class) {
          if (negate) {
            throw std::runtime_error(std::string("regex escape \\") + e +
                                     " inside a character class is not supported");
          }
          out += members;
        } else {
          out += negate ? "[^" : "[";
          out += members;
          out += "]";
        }
      };
      switch (e) {
        case 's': set(kSpaceSet, false); break;
        case 'S': set(kSpaceSet, true); break;
        case 'w': set(kWordSet, false); break;
        case 'W': set(kWordSet, true); break;
        case 'h': set(kHexSet, false); break;
        case 'H': set(kHexSet, true); break;
        case 'd': out += "\\p{Nd}"; break;
        case 'D': out += "\\P{Nd}"; break;
        case 'b':
        case 'B':
          if (in_class) {
            out += "\\b";  // backspace in both
          } else {
            const std::string w = std::string("[") + kWordSet + "]";
            if (e == 'b') {
              out += "(?:(?<=" + w + ")(?!" + w + ")|(?<!" + w + ")(?=" + w + "))";
            } else {
              out += "(?:(?<=" + w + ")(?=" + w + ")|(?<!" + w + ")(?!" + w + "))";
            }
          }
          break;
        case 'u':
          if (i + 5 < p.size() && is_hex(p[i + 2]) && is_hex(p[i + 3]) && is_hex(p[i + 4]) &&
              is_hex(p[i + 5])) {
            out += "\\x{";
            out.append(p.substr(i + 2, 4));
            out += "}";
            i += 4;
          } else {
            out += "\\u";
          }
          break;
        default:
          out += c;
          out += e;
      }
      ++i;
      class_start = false;
      continue;
    }
    if (c == '[') {
      if (class_depth > 0 && !class_start && i + 1 < p.size() && p[i + 1] == ':') {
        out += c;  // POSIX bracket [:alpha:] inside a class
        const size_t close = p.find(":]", i + 2);
        if (close != std::string_view::npos) {
          out.append(p.substr(i + 1, close + 2 - (i + 1)));
          i = close + 1;
        }
        continue;
      }
      if (class_depth > 0) throw std::runtime_error("nested character classes are not supported");
      ++class_depth;
      out += c;
      class_start = true;
      if (i + 1 < p.size() && p[i + 1] == '^') {
        out += '^';
        ++i;
      }
      continue;
    }
    if (c == ']' && class_depth > 0 && !class_start) {
      --class_depth;
      out += c;
      continue;
    }
    class_start = false;
    out += c;
  }
  return out;
}

namespace {

// Per-thread PCRE2 state: one match data (group 0 only) and a JIT stack large enough for long
// whitespace runs under lookaheads.
struct ThreadMatch {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mc = nullptr;
  pcre2_jit_stack* js = nullptr;
  ThreadMatch() {
    md = pcre2_match_data_create(1, nullptr);
    mc = pcre2_match_context_create(nullptr);
    js = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    if (!md || !mc || !js) throw std::bad_alloc();
    pcre2_jit_stack_assign(mc, nullptr, js);
  }
  ~ThreadMatch() {
    pcre2_jit_stack_free(js);
    pcre2_match_context_free(mc);
    pcre2_match_data_free(md);
  }
};

ThreadMatch& thread_match() {
  thread_local ThreadMatch tm;
  return tm;
}

}  // namespace

Regex::Regex(std::string_view onig_pattern) : pattern_(onig_pattern) {
  const std::string translated = onig_to_pcre2(onig_pattern);
  int err = 0;
  PCRE2_SIZE erroff = 0;
  // Ruby syntax: ^ and $ are line anchors.
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &erroff, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw std::runtime_error("regex '" + pattern_ + "' does not compile: " +
                             reinterpret_cast<const char*>(msg) + " at offset " + std::to_string(erroff));
  }
  code_ = code;
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

bool Regex::find_at(std::string_view text, size_t from, size_t* start, size_t* end) const {
  ThreadMatch& tm = thread_match();
  auto* code = static_cast<pcre2_code*>(code_);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const int rc = jit_ ? pcre2_jit_match(code, subject, text.size(), from, 0, tm.md, tm.mc)
                      : pcre2_match(code, subject, text.size(), from, PCRE2_NO_UTF_CHECK, tm.md, tm.mc);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    throw std::runtime_error("regex '" + pattern_ + "': match failed: " + reinterpret_cast<const char*>(msg));
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(tm.md);
  *start = ov[0];
  *end = ov[1];
  return true;
}

void Regex::find_all(std::string_view text, std::vector<std::pair<uint32_t, uint32_t>>& out) const {
  size_t last_end = 0;
  size_t last_match_end = kNpos;
  while (last_end <= text.size()) {
    size_t s, e;
    if (!find_at(text, last_end, &s, &e)) break;
    if (s == e && last_match_end == e) {
      // onig's find_iter: no empty match right after the previous match; step one character.
      if (last_end >= text.size()) break;
      last_end += size_t(utf8_len(static_cast<uint8_t>(text[last_end])));
      continue;
    }
    last_end = e;
    last_match_end = e;
    out.emplace_back(uint32_t(s), uint32_t(e));
  }
}

}  // namespace strata::text::detail
