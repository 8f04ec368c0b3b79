// UTF-8 validation and lossy decoding, the Unicode predicates of the Rust library through ICU,
// normalization with offsets (ICU Normalizer2, segment by segment), the byte-level alphabet.
#include "text/tokenizer_unicode.h"

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <stdexcept>

namespace strata::text::detail {

namespace {

// Byte length of the valid UTF-8 sequence at s[i], or -(bytes of its maximal invalid subpart).
int utf8_step(const uint8_t* s, size_t n, size_t i) {
  const uint8_t b0 = s[i];
  if (b0 < 0x80) return 1;
  int need;
  uint8_t lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return -1;
  }
  for (int k = 1; k <= need; ++k) {
    if (i + k >= n) return -k;
    const uint8_t b = s[i + k];
    const uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return -k;
  }
  return need + 1;
}

}  // namespace

size_t find_invalid_utf8(std::string_view s) {
  const auto* u = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    // ASCII runs 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      __builtin_memcpy(&w, u + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const int step = utf8_step(u, n, i);
    if (step < 0) return i;
    i += size_t(step);
  }
  return kNpos;
}

std::string utf8_lossy(std::string_view bytes) {
  const auto* u = reinterpret_cast<const uint8_t*>(bytes.data());
  const size_t n = bytes.size();
  std::string out;
  out.reserve(n);
  size_t i = 0;
  while (i < n) {
    const int step = utf8_step(u, n, i);
    if (step > 0) {
      out.append(bytes.data() + i, size_t(step));
      i += size_t(step);
    } else {
      out += "\xEF\xBF\xBD";
      i += size_t(-step);
    }
  }
  return out;
}

bool is_white_space(uint32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 9 && cp <= 13);
  return u_isUWhiteSpace(UChar32(cp));
}

bool is_word_char(uint32_t cp) {
  if (cp < 0x80) {
    return (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || (cp >= '0' && cp <= '9') || cp == '_';
  }
  if (cp == 0x200C || cp == 0x200D) return true;  // Join_Control
  if (u_hasBinaryProperty(UChar32(cp), UCHAR_ALPHABETIC)) return true;
  const int8_t t = u_charType(UChar32(cp));
  return t == U_NON_SPACING_MARK || t == U_ENCLOSING_MARK || t == U_COMBINING_SPACING_MARK ||
         t == U_DECIMAL_DIGIT_NUMBER || t == U_CONNECTOR_PUNCTUATION;
}

bool is_numeric(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  const int8_t t = u_charType(UChar32(cp));
  return t == U_DECIMAL_DIGIT_NUMBER || t == U_LETTER_NUMBER || t == U_OTHER_NUMBER;
}

void append_lowercase(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp >= 'A' && cp <= 'Z' ? cp + 32 : cp));
    return;
  }
  if (cp == 0x130) {  // the one unconditional multi-character lowercase mapping (SpecialCasing)
    out += "i\xCC\x87";
    return;
  }
  append_utf8(out, uint32_t(u_tolower(UChar32(cp))));
}

namespace {

const icu::Normalizer2& normalizer_for(NormForm form) {
  UErrorCode ec = U_ZERO_ERROR;
  const icu::Normalizer2* n = nullptr;
  switch (form) {
    case NormForm::NFC: n = icu::Normalizer2::getNFCInstance(ec); break;
    case NormForm::NFD: n = icu::Normalizer2::getNFDInstance(ec); break;
    case NormForm::NFKC: n = icu::Normalizer2::getNFKCInstance(ec); break;
    case NormForm::NFKD: n = icu::Normalizer2::getNFKDInstance(ec); break;
  }
  if (U_FAILURE(ec) || n == nullptr) {
    throw std::runtime_error(std::string("ICU: cannot load the normalizer: ") + u_errorName(ec));
  }
  return *n;
}

bool is_ascii(std::string_view s) {
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    __builtin_memcpy(&w, s.data() + i, 8);
    if (w & 0x8080808080808080ull) return false;
  }
  for (; i < s.size(); ++i) {
    if (static_cast<uint8_t>(s[i]) >= 0x80) return false;
  }
  return true;
}

void copy_with_orig(std::string_view text, const uint32_t* orig, size_t b, size_t e, std::string& out,
                    std::vector<uint32_t>* out_orig) {
  out.append(text.data() + b, e - b);
  if (out_orig) out_orig->insert(out_orig->end(), orig + b, orig + e);
}


// Origins of the normalized characters of one segment, as the Rust alignments come out of
// unicode-normalization-alignments: each input character decomposes into its first character
// (taking that input character) and inserted ones (taking the previous origin); canonical reordering
// moves characters but not their tags; a composition folds the second character's input into the
// starter. Output characters then take input characters in order.
void segment_origins(const icu::Normalizer2& norm, NormForm form, std::string_view seg, std::string_view seg_out,
                     const uint32_t* orig, std::vector<uint32_t>& out_orig) {
  struct DC {
    uint32_t cp;
    int change;  // 0: takes one input character, -n: takes 1 + n, +1: takes none
  };
  std::vector<DC> d;
  std::vector<size_t> in_pos;  // byte offset of each input character in seg
  int len;
  icu::UnicodeString dec;
  for (size_t k = 0; k < seg.size(); k += size_t(len)) {
    const uint32_t cp = decode_utf8(seg.data() + k, &len);
    in_pos.push_back(k);
    if (norm.getDecomposition(UChar32(cp), dec)) {
      int first = 1;
      for (int32_t i = 0; i < dec.length();) {
        const UChar32 c = dec.char32At(i);
        d.push_back({uint32_t(c), first ? 0 : 1});
        first = 0;
        i += U16_LENGTH(c);
      }
    } else {
      d.push_back({cp, 0});
    }
  }
  // Canonical ordering: a stable sort of each run of non-starters by combining class.
  auto ccc = [&](uint32_t cp) { return int(norm.getCombiningClass(UChar32(cp))); };
  for (size_t i = 1; i < d.size(); ++i) {
    const int c = ccc(d[i].cp);
    if (c == 0) continue;
    for (size_t j = i; j > 0; --j) {
      const int p = ccc(d[j - 1].cp);
      if (p == 0 || p <= c) break;
      std::swap(d[j - 1].cp, d[j].cp);  // the tags stay in place, as in the Rust crate
    }
  }
  if (form == NormForm::NFC || form == NormForm::NFKC) {
    std::vector<DC> out;
    long starter = -1;
    for (const DC& x : d) {
      const int c = ccc(x.cp);
      if (starter >= 0) {
        const bool adjacent = size_t(starter) + 1 == out.size();
        const int last = adjacent ? -1 : ccc(out.back().cp);
        const bool blocked = !adjacent && (last == 0 || last >= c);
        if (!blocked) {
          const UChar32 comp = norm.composePair(UChar32(out[size_t(starter)].cp), UChar32(x.cp));
          if (comp >= 0) {
            out[size_t(starter)].cp = uint32_t(comp);
            out[size_t(starter)].change += x.change - 1;
            continue;
          }
        }
      }
      if (c == 0) starter = long(out.size());
      out.push_back(x);
    }
    d.swap(out);
  }
  std::string text;
  for (const DC& x : d) append_utf8(text, x.cp);
  if (text != seg_out) {  // not the library's result: every character takes the segment's first origin
    out_orig.insert(out_orig.end(), seg_out.size(), orig[0]);
    return;
  }
  size_t next = 0;
  uint32_t prev = orig[0];
  for (const DC& x : d) {
    uint32_t o = prev;
    if (x.change <= 0 && next < in_pos.size()) {
      o = orig[in_pos[next]];
      next += size_t(1 - x.change);
    }
    std::string tmp;
    append_utf8(tmp, x.cp);
    out_orig.insert(out_orig.end(), tmp.size(), o);
    prev = o;
  }
}

}  // namespace

void unicode_normalize(NormForm form, std::string_view text, const uint32_t* orig, std::string& out,
                       std::vector<uint32_t>* out_orig) {
  out.clear();
  if (out_orig) out_orig->clear();
  if (is_ascii(text)) {  // ASCII is stable under every normalization form
    copy_with_orig(text, orig, 0, text.size(), out, out_orig);
    return;
  }
  const icu::Normalizer2& norm = normalizer_for(form);
  UErrorCode ec = U_ZERO_ERROR;
  const bool normalized =
      norm.isNormalizedUTF8(icu::StringPiece(text.data(), int32_t(text.size())), ec) && U_SUCCESS(ec);
  if (normalized) {
    copy_with_orig(text, orig, 0, text.size(), out, out_orig);
    return;
  }
  // Segments start at characters with a normalization boundary before them, so each normalizes on
  // its own. An output character takes the offset of an equal input character of its segment, or
  // else that of the segment's first character (what a composition or decomposition derives from).
  std::string seg_out;
  size_t i = 0;
  const size_t n = text.size();
  while (i < n) {
    const size_t seg_b = i;
    int len;
    decode_utf8(text.data() + i, &len);
    i += size_t(len);
    while (i < n) {
      const uint32_t cp = decode_utf8(text.data() + i, &len);
      if (cp < 0x80 || norm.hasBoundaryBefore(UChar32(cp))) break;
      i += size_t(len);
    }
    const std::string_view seg = text.substr(seg_b, i - seg_b);
    if (seg.size() == 1) {
      copy_with_orig(text, orig, seg_b, i, out, out_orig);
      continue;
    }
    ec = U_ZERO_ERROR;
    icu::UnicodeString u = icu::UnicodeString::fromUTF8(icu::StringPiece(seg.data(), int32_t(seg.size())));
    icu::UnicodeString normed = norm.normalize(u, ec);
    if (U_FAILURE(ec)) throw std::runtime_error(std::string("ICU normalize failed: ") + u_errorName(ec));
    seg_out.clear();
    normed.toUTF8String(seg_out);
    if (seg_out == seg) {
      copy_with_orig(text, orig, seg_b, i, out, out_orig);
      continue;
    }
    if (out_orig) segment_origins(norm, form, seg, seg_out, orig + seg_b, *out_orig);
    out += seg_out;
  }
}

namespace {

std::array<uint32_t, 256> make_byte_to_char() {
  std::array<uint32_t, 256> t{};
  uint32_t n = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    t[b] = printable ? b : 256 + n++;
  }
  return t;
}

}  // namespace

const std::array<uint32_t, 256> kByteToChar = make_byte_to_char();

int char_to_byte(uint32_t cp) {
  if (cp < 256) {
    const bool printable = (cp >= '!' && cp <= '~') || (cp >= 0xA1 && cp <= 0xAC) || (cp >= 0xAE);
    return printable ? int(cp) : -1;
  }
  static const std::array<int, 68> high = [] {
    std::array<int, 68> h{};
    h.fill(-1);
    for (int b = 0; b < 256; ++b) {
      if (kByteToChar[b] >= 256) h[kByteToChar[b] - 256] = b;
    }
    return h;
  }();
  return cp - 256 < high.size() ? high[cp - 256] : -1;
}

bool byte_level_to_bytes(std::string_view token, std::string& out) {
  out.clear();
  for (size_t i = 0; i < token.size();) {
    int len;
    const uint32_t cp = decode_utf8(token.data() + i, &len);
    const int b = char_to_byte(cp);
    if (b < 0) return false;
    out.push_back(char(b));
    i += size_t(len);
  }
  return true;
}

}  // namespace strata::text::detail
