// Jinja2's lexer (jinja2/lexer.py) for the default delimiters with trim_blocks and lstrip_blocks:
// the same whitespace rules (a '-' strips all whitespace on that side, '+' keeps it, lstrip removes
// spaces and tabs from the start of a line up to a block or comment tag, trim_blocks eats the
// newline after one), the same number and string literals (strings decoded as Python's
// "unicode-escape" after backslashreplace, exactly as Jinja does), and bracket balancing so that
// "}}" inside a dict literal does not end a tag.
#include "text/jinja_lexer.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "text/jinja_internal.h"

namespace strata::text::jinja {

namespace {

class Lexer {
 public:
  Lexer(std::string_view source, const std::string& name) : name_(name) {
    // Jinja2 splits on \r\n, \r and \n and joins with \n; one trailing newline is dropped
    // (keep_trailing_newline=False).
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_.push_back('\n');
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_.push_back(source[i]);
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      // The next tag start, whichever of {{ {% {# comes first.
      size_t k = std::string::npos;
      char kind = 0;
      for (size_t p = src_.find('{', pos); p != std::string::npos; p = src_.find('{', p + 1)) {
        if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) {
          k = p;
          kind = src_[p + 1];
          break;
        }
      }
      if (k == std::string::npos) {
        emit_data(pos, src_.size(), src_.substr(pos));
        break;
      }
      const char sign = k + 2 < src_.size() && (src_[k + 2] == '-' || src_[k + 2] == '+') ? src_[k + 2] : 0;
      std::string text = src_.substr(pos, k - pos);
      if (sign == '-') {
        text = rstrip_whitespace(text);
      } else if (sign != '+' && kind != '{') {  // lstrip_blocks: block and comment tags only
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        if ((l_pos > 0 || line_starting) && l_pos < text.size() && all_whitespace(text, l_pos)) text.resize(l_pos);
      }
      emit_data(pos, k, std::move(text));
      pos = k + 2 + (sign ? 1 : 0);
      if (kind == '#') {
        pos = comment(k, pos);
      } else {
        if (kind == '%') check_raw(k, pos);
        pos = tag(k, pos, kind == '%');
      }
      line_starting = src_[pos - 1] == '\n';
    }
    tokens_.push_back(Token{Tok::Eof, "", 0, 0, static_cast<int>(line_starts_.size()), 1});
    const auto [line, col] = position(src_.size());
    tokens_.back().line = line;
    tokens_.back().column = col;
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void error(size_t at, const std::string& msg) const {
    const auto [line, col] = position(at);
    throw Error(name_, line, col, msg);
  }

  std::pair<int, int> position(size_t at) const {
    const auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), at);
    const size_t line_idx = static_cast<size_t>(it - line_starts_.begin()) - 1;
    const size_t start = line_starts_[line_idx];
    return {static_cast<int>(line_idx + 1),
            static_cast<int>(utf8_length(std::string_view(src_).substr(start, at - start)) + 1)};
  }

  // The code point at byte i and its length.
  char32_t cp_at(size_t i, size_t& len) const {
    const std::string_view rest = std::string_view(src_).substr(i, 4);
    const auto c = static_cast<unsigned char>(src_[i]);
    len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : 4;
    len = std::min(len, rest.size());
    const std::vector<char32_t> cps = utf8_decode(rest.substr(0, len));
    return cps.empty() ? 0 : cps[0];
  }

  size_t skip_whitespace(size_t pos) const {
    while (pos < src_.size()) {
      size_t len;
      if (!py_isspace(cp_at(pos, len))) break;
      pos += len;
    }
    return pos;
  }

  static std::string rstrip_whitespace(const std::string& s) {
    const std::vector<char32_t> cps = utf8_decode(s);
    size_t e = cps.size();
    while (e > 0 && py_isspace(cps[e - 1])) --e;
    return utf8_encode(cps, 0, e);
  }

  static bool all_whitespace(const std::string& s, size_t from) {
    for (char32_t c : utf8_decode(std::string_view(s).substr(from)))
      if (!py_isspace(c)) return false;
    return true;
  }

  void emit_data(size_t at, size_t /*end*/, std::string text) {
    if (text.empty()) return;
    push(Tok::Data, at, std::move(text));
  }

  Token& push(Tok type, size_t at, std::string text) {
    const auto [line, col] = position(at);
    tokens_.push_back(Token{type, std::move(text), 0, 0, line, col});
    return tokens_.back();
  }

  // {# ... #}: dropped; '-#}' strips following whitespace, '#}' eats one newline (trim_blocks).
  size_t comment(size_t start, size_t pos) {
    const size_t q = src_.find("#}", pos);
    if (q == std::string::npos) error(start, "missing end of comment tag");
    const char end_sign = q > pos && (src_[q - 1] == '-' || src_[q - 1] == '+') ? src_[q - 1] : 0;
    size_t after = q + 2;
    if (end_sign == '-') {
      after = skip_whitespace(after);
    } else if (end_sign == 0 && after < src_.size() && src_[after] == '\n') {
      ++after;
    }
    return after;
  }

  void check_raw(size_t start, size_t pos) const {
    size_t p = skip_whitespace(pos);
    if (src_.compare(p, 3, "raw") != 0) return;
    p = skip_whitespace(p + 3);
    if (src_.compare(p, 3, "-%}") == 0 || src_.compare(p, 2, "%}") == 0)
      error(start, "unsupported tag 'raw'");
  }

  // The tokens of a {{ }} or {% %} tag; returns the position after its end.
  size_t tag(size_t start, size_t pos, bool block) {
    push(block ? Tok::BlockBegin : Tok::VarBegin, start, block ? "{%" : "{{");
    std::vector<std::pair<char, size_t>> balance;  // open brackets and where
    while (true) {
      if (pos >= src_.size()) {
        if (!balance.empty()) error(balance.back().second, std::string("unclosed '") + balance.back().first + "'");
        error(start, block ? "unexpected end of template: missing '%}'" : "unexpected end of template: missing '}}'");
      }
      if (balance.empty()) {
        if (block) {
          if (src_.compare(pos, 3, "-%}") == 0) {
            push(Tok::BlockEnd, pos, "%}");
            return skip_whitespace(pos + 3);
          }
          if (src_.compare(pos, 3, "+%}") == 0) {
            push(Tok::BlockEnd, pos, "%}");
            return pos + 3;
          }
          if (src_.compare(pos, 2, "%}") == 0) {
            push(Tok::BlockEnd, pos, "%}");
            pos += 2;
            if (pos < src_.size() && src_[pos] == '\n') ++pos;  // trim_blocks
            return pos;
          }
        } else {
          if (src_.compare(pos, 3, "-}}") == 0) {
            push(Tok::VarEnd, pos, "}}");
            return skip_whitespace(pos + 3);
          }
          if (src_.compare(pos, 2, "}}") == 0) {
            push(Tok::VarEnd, pos, "}}");
            return pos + 2;
          }
        }
      }
      size_t len;
      if (py_isspace(cp_at(pos, len))) {
        pos = skip_whitespace(pos);
        continue;
      }
      const char c = src_[pos];
      if (std::isdigit(static_cast<unsigned char>(c))) {
        pos = number(pos);
      } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = pos;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        push(Tok::Name, pos, src_.substr(pos, e - pos));
        pos = e;
      } else if (c == '\'' || c == '"') {
        pos = string(pos);
      } else {
        pos = op(pos, balance);
      }
    }
  }

  size_t op(size_t pos, std::vector<std::pair<char, size_t>>& balance) {
    static const char* const kTwo[] = {"//", "**", "==", "!=", ">=", "<="};
    for (const char* t : kTwo)
      if (src_.compare(pos, 2, t) == 0) {
        push(Tok::Op, pos, t);
        return pos + 2;
      }
    const char c = src_[pos];
    if (!std::strchr("+-/*%~[](){}><=.:|,;", c)) {
      size_t len;
      std::string ch;
      utf8_append(ch, cp_at(pos, len));
      error(pos, "unexpected char '" + ch + "'");
    }
    if (c == '(' || c == '[' || c == '{') {
      balance.emplace_back(c, pos);
    } else if (c == ')' || c == ']' || c == '}') {
      const char want = c == ')' ? '(' : c == ']' ? '[' : '{';
      if (balance.empty()) error(pos, std::string("unexpected '") + c + "'");
      if (balance.back().first != want) {
        const char expected = balance.back().first == '(' ? ')' : balance.back().first == '[' ? ']' : '}';
        error(pos, std::string("unexpected '") + c + "', expected '" + expected + "'");
      }
      balance.pop_back();
    }
    push(Tok::Op, pos, std::string(1, c));
    return pos + 1;
  }

  // Digits with optional '_' separators: (\d+_)*\d+
  size_t digits(size_t p) const {
    const size_t start = p;
    while (p < src_.size()) {
      if (std::isdigit(static_cast<unsigned char>(src_[p]))) {
        ++p;
      } else if (src_[p] == '_' && p > start && p + 1 < src_.size() && std::isdigit(static_cast<unsigned char>(src_[p + 1]))) {
        ++p;
      } else {
        break;
      }
    }
    return p;
  }

  size_t number(size_t pos) {
    const bool after_dot = pos > 0 && src_[pos - 1] == '.';
    // Float: digits then a fraction and/or an exponent (not right after a '.', as in Jinja).
    if (!after_dot) {
      size_t p = digits(pos);
      bool is_float = false;
      if (p + 1 < src_.size() && src_[p] == '.' && std::isdigit(static_cast<unsigned char>(src_[p + 1]))) {
        p = digits(p + 1);
        is_float = true;
      }
      if (p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
        size_t q = p + 1;
        if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
        if (q < src_.size() && std::isdigit(static_cast<unsigned char>(src_[q]))) {
          p = digits(q);
          is_float = true;
        }
      }
      if (is_float) {
        std::string text = src_.substr(pos, p - pos);
        text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
        Token& t = push(Tok::Float, pos, text);
        t.float_value = std::strtod(text.c_str(), nullptr);
        return p;
      }
    }
    // Integer: 0b/0o/0x prefixes, [1-9](_?\d)*, or 0(_?0)*
    int base = 10;
    size_t p = pos;
    if (src_[pos] == '0' && pos + 1 < src_.size() && std::strchr("bBoOxX", src_[pos + 1]) && pos + 2 < src_.size()) {
      const char b = static_cast<char>(std::tolower(static_cast<unsigned char>(src_[pos + 1])));
      base = b == 'b' ? 2 : b == 'o' ? 8 : 16;
      p = pos + 2;
      const auto ok = [&](char ch) {
        const int d = std::isdigit(static_cast<unsigned char>(ch)) ? ch - '0'
                      : std::isxdigit(static_cast<unsigned char>(ch)) ? std::tolower(static_cast<unsigned char>(ch)) - 'a' + 10
                                                                       : 99;
        return d < base;
      };
      const size_t digits_start = p;
      while (p < src_.size() && (ok(src_[p]) || (src_[p] == '_' && p + 1 < src_.size() && ok(src_[p + 1])))) ++p;
      if (p == digits_start) {
        base = 10;
        p = pos;
      }
    }
    if (base == 10) {
      if (src_[pos] == '0') {
        p = pos + 1;
        while (p < src_.size() && (src_[p] == '0' || (src_[p] == '_' && p + 1 < src_.size() && src_[p + 1] == '0'))) ++p;
      } else {
        p = digits(pos);
      }
    }
    std::string text = src_.substr(pos, p - pos);
    std::string clean = text.substr(base == 10 ? 0 : 2);
    clean.erase(std::remove(clean.begin(), clean.end(), '_'), clean.end());
    errno = 0;
    const unsigned long long v = std::strtoull(clean.c_str(), nullptr, base);
    if (errno == ERANGE || v > static_cast<unsigned long long>(INT64_MAX))
      error(pos, "integer literal " + text + " does not fit in 64 bits");
    Token& t = push(Tok::Int, pos, text);
    t.int_value = static_cast<int64_t>(v);
    return p;
  }

  size_t string(size_t pos) {
    const char quote = src_[pos];
    size_t p = pos + 1;
    while (p < src_.size() && src_[p] != quote) {
      if (src_[p] == '\\') ++p;
      ++p;
    }
    if (p >= src_.size()) error(pos, std::string("unexpected char '") + quote + "' (unterminated string)");
    Token& t = push(Tok::String, pos, "");
    t.text = decode_string(std::string_view(src_).substr(pos + 1, p - pos - 1), pos);
    return p + 1;
  }

  // value.encode("ascii", "backslashreplace").decode("unicode-escape"), as Jinja decodes literals.
  std::string decode_string(std::string_view raw, size_t at) const {
    std::string ascii;
    char buf[16];
    for (char32_t c : utf8_decode(raw)) {
      if (c < 0x80) {
        ascii.push_back(static_cast<char>(c));
      } else {
        if (c <= 0xFF) std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
        else if (c <= 0xFFFF) std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
        else std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(c));
        ascii += buf;
      }
    }
    std::string out;
    for (size_t i = 0; i < ascii.size(); ++i) {
      const char c = ascii[i];
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (i + 1 >= ascii.size()) error(at, "\\ at end of string");
      const char e = ascii[++i];
      const auto hex = [&](int n) -> char32_t {
        if (i + static_cast<size_t>(n) >= ascii.size()) error(at, std::string("truncated \\") + e + " escape");
        char32_t v = 0;
        for (int k = 1; k <= n; ++k) {
          const char h = ascii[i + static_cast<size_t>(k)];
          if (!std::isxdigit(static_cast<unsigned char>(h))) error(at, std::string("truncated \\") + e + " escape");
          v = v * 16 + static_cast<char32_t>(std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : std::tolower(static_cast<unsigned char>(h)) - 'a' + 10);
        }
        i += static_cast<size_t>(n);
        return v;
      };
      switch (e) {
        case '\n': break;  // line continuation
        case '\\': out.push_back('\\'); break;
        case '\'': out.push_back('\''); break;
        case '"': out.push_back('"'); break;
        case 'a': out.push_back('\a'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'v': out.push_back('\v'); break;
        case 'x': utf8_append(out, hex(2)); break;
        case 'u': utf8_append(out, hex(4)); break;
        case 'U': {
          const char32_t v = hex(8);
          if (v > 0x10FFFF) error(at, "illegal Unicode character");
          utf8_append(out, v);
          break;
        }
        case 'N': error(at, "unsupported: \\N{...} escapes in string literals");
        default:
          if (e >= '0' && e <= '7') {
            char32_t v = static_cast<char32_t>(e - '0');
            for (int k = 0; k < 2 && i + 1 < ascii.size() && ascii[i + 1] >= '0' && ascii[i + 1] <= '7'; ++k)
              v = v * 8 + static_cast<char32_t>(ascii[++i] - '0');
            utf8_append(out, v);
          } else {
            out.push_back('\\');  // unknown escapes keep their backslash
            out.push_back(e);
          }
      }
    }
    if (!utf8_valid(out)) error(at, "string literal decodes to a lone surrogate");
    return out;
  }

  const std::string& name_;
  std::string src_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex(std::string_view source, const std::string& name) {
  if (!utf8_valid(source)) throw Error(name, 1, 1, "template is not valid UTF-8");
  return Lexer(source, name).run();
}

}  // namespace strata::text::jinja
