// Python's str semantics on UTF-8: code points, str.isspace(), isprintable() (for repr), and the
// case mappings of upper/lower/title/capitalize (full mappings, through ICU's root locale).
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/locid.h>

#include "text/jinja_internal.h"

namespace strata::text::jinja {

std::vector<char32_t> utf8_decode(std::string_view s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = 0;
    char32_t cp = 0;
    if (c < 0x80) {
      cp = c;
      n = 1;
    } else if ((c >> 5) == 0x6) {
      cp = c & 0x1F;
      n = 2;
    } else if ((c >> 4) == 0xE) {
      cp = c & 0x0F;
      n = 3;
    } else if ((c >> 3) == 0x1E) {
      cp = c & 0x07;
      n = 4;
    } else {
      out.push_back(0xFFFD);  // not reached for validated input
      ++i;
      continue;
    }
    if (i + static_cast<size_t>(n) > s.size()) {
      out.push_back(0xFFFD);
      break;
    }
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += static_cast<size_t>(n);
  }
  return out;
}

void utf8_append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string utf8_encode(const std::vector<char32_t>& cps, size_t begin, size_t end) {
  std::string out;
  end = std::min(end, cps.size());
  for (size_t i = begin; i < end; ++i) utf8_append(out, cps[i]);
  return out;
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

bool utf8_valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n;
    char32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      n = 2, cp = c & 0x1F;
    } else if ((c >> 4) == 0xE) {
      n = 3, cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
      return false;
    i += n;
  }
  return true;
}

// CPython's _PyUnicode_IsWhitespace: bidirectional types WS, B, S and category Zs.
bool py_isspace(char32_t c) {
  switch (c) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D:
    case 0x1C: case 0x1D: case 0x1E: case 0x1F: case 0x20:
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029:
    case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

bool py_isprintable(char32_t c) {
  if (c == ' ') return true;
  if (c < 0x7F) return c >= 0x20;
  switch (u_charType(static_cast<UChar32>(c))) {
    case U_CONTROL_CHAR: case U_FORMAT_CHAR: case U_SURROGATE: case U_PRIVATE_USE_CHAR:
    case U_GENERAL_OTHER_TYPES: case U_LINE_SEPARATOR: case U_PARAGRAPH_SEPARATOR:
    case U_SPACE_SEPARATOR:
      return false;
    default:
      return true;
  }
}

namespace {

bool is_ascii(std::string_view s) {
  for (char c : s)
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  return true;
}

std::string to_utf8(const icu::UnicodeString& u) {
  std::string out;
  u.toUTF8String(out);
  return out;
}

icu::UnicodeString from_utf8(std::string_view s) {
  return icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
}

std::string title_cp(char32_t c) {
  if (c < 0x80) return std::string(1, static_cast<char>(c >= 'a' && c <= 'z' ? c - 32 : c));
  icu::UnicodeString u(static_cast<UChar32>(c));
  u.toTitle(nullptr, icu::Locale::getRoot(), U_TITLECASE_NO_BREAK_ADJUSTMENT | U_TITLECASE_NO_LOWERCASE);
  return to_utf8(u);
}

std::string lower_cp(char32_t c) {
  if (c < 0x80) return std::string(1, static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c));
  icu::UnicodeString u(static_cast<UChar32>(c));
  u.toLower(icu::Locale::getRoot());
  return to_utf8(u);
}

bool is_cased(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_CASED);
}

}  // namespace

std::string py_upper(std::string_view s) {
  if (is_ascii(s)) {
    std::string out(s);
    for (char& c : out)
      if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
    return out;
  }
  return to_utf8(from_utf8(s).toUpper(icu::Locale::getRoot()));
}

std::string py_lower(std::string_view s) {
  if (is_ascii(s)) {
    std::string out(s);
    for (char& c : out)
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
    return out;
  }
  return to_utf8(from_utf8(s).toLower(icu::Locale::getRoot()));
}

// CPython do_title: a character after a cased one is lowercased, any other is titlecased.
std::string py_title(std::string_view s) {
  std::string out;
  bool previous_cased = false;
  for (char32_t c : utf8_decode(s)) {
    out += previous_cased ? lower_cp(c) : title_cp(c);
    previous_cased = is_cased(c);
  }
  return out;
}

// CPython do_capitalize (3.8+): titlecase the first character, lowercase the rest.
std::string py_capitalize(std::string_view s) {
  const std::vector<char32_t> cps = utf8_decode(s);
  if (cps.empty()) return {};
  return title_cp(cps[0]) + py_lower(utf8_encode(cps, 1));
}

std::string py_strip(std::string_view s, const Value& chars, bool left, bool right) {
  std::vector<char32_t> set;
  const bool whitespace = chars.is_undefined() || chars.is_none();
  if (!whitespace) {
    if (!chars.is_string()) fail("strip arg must be None or str");
    set = utf8_decode(chars.as_string());
  }
  const auto strip_it = [&](char32_t c) {
    if (whitespace) return py_isspace(c);
    return std::find(set.begin(), set.end(), c) != set.end();
  };
  // Only the ends are decoded (a template strips every message's content): the code point that
  // starts at byte i, and its length.
  const auto cp_at = [&](size_t i, size_t& len) -> char32_t {
    const auto c = static_cast<unsigned char>(s[i]);
    len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1;  // as utf8_decode
    if (i + len > s.size()) len = 1;
    return utf8_decode(s.substr(i, len)).at(0);
  };
  size_t b = 0, e = s.size();
  if (left) {
    while (b < e) {
      size_t len;
      if (!strip_it(cp_at(b, len))) break;
      b += len;
    }
  }
  if (right) {
    while (e > b) {
      size_t start = e - 1;  // back over continuation bytes to the start of the last code point
      while (start > b && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
      size_t len;
      if (!strip_it(cp_at(start, len))) break;
      e = start;
    }
  }
  return std::string(s.substr(b, e - b));
}

bool py_isdecimal(char32_t c) {
  return u_getIntPropertyValue(static_cast<UChar32>(c), UCHAR_NUMERIC_TYPE) == U_NT_DECIMAL;
}
bool py_isdigit(char32_t c) {
  const int t = u_getIntPropertyValue(static_cast<UChar32>(c), UCHAR_NUMERIC_TYPE);
  return t == U_NT_DECIMAL || t == U_NT_DIGIT;
}
bool py_isnumeric(char32_t c) {
  return u_getIntPropertyValue(static_cast<UChar32>(c), UCHAR_NUMERIC_TYPE) != U_NT_NONE;
}
bool py_isalpha(char32_t c) { return u_isalpha(static_cast<UChar32>(c)); }
bool py_islower_cp(char32_t c) { return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_LOWERCASE); }
bool py_isupper_cp(char32_t c) { return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_UPPERCASE); }
bool py_istitle_cp(char32_t c) { return u_istitle(static_cast<UChar32>(c)); }

std::vector<std::string> py_splitlines(std::string_view s, bool keepends) {
  const std::vector<char32_t> cps = utf8_decode(s);
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t i = 0; i < cps.size(); ++i) {
    const char32_t c = cps[i];
    const bool brk = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D ||
                     c == 0x1E || c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!brk) continue;
    size_t eol = i + 1;
    if (c == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') eol = i + 2;
    lines.push_back(utf8_encode(cps, start, keepends ? eol : i));
    start = eol;
    i = eol - 1;
  }
  if (start < cps.size()) lines.push_back(utf8_encode(cps, start));
  return lines;
}

}  // namespace strata::text::jinja
