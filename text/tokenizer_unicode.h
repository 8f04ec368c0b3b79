// UTF-8 and Unicode helpers for the tokenizer: decoding, the character classes the Rust library
// uses (char::is_whitespace, regex \w, char::is_numeric), Unicode normalization with offsets, and
// GPT-2's byte-level alphabet (each byte shown as a printable character).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace strata::text::detail {

inline constexpr size_t kNpos = static_cast<size_t>(-1);

// Length of the UTF-8 sequence that starts with `lead` (1 for a continuation byte, so loops advance).
inline int utf8_len(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead < 0xE0) return lead < 0xC0 ? 1 : 2;
  if (lead < 0xF0) return 3;
  return 4;
}

// The code point at p (valid UTF-8 assumed); *len gets its byte length.
inline uint32_t decode_utf8(const char* p, int* len) {
  const auto* u = reinterpret_cast<const uint8_t*>(p);
  if (u[0] < 0x80) { *len = 1; return u[0]; }
  if (u[0] < 0xE0) { *len = 2; return (uint32_t(u[0] & 0x1F) << 6) | (u[1] & 0x3F); }
  if (u[0] < 0xF0) {
    *len = 3;
    return (uint32_t(u[0] & 0x0F) << 12) | (uint32_t(u[1] & 0x3F) << 6) | (u[2] & 0x3F);
  }
  *len = 4;
  return (uint32_t(u[0] & 0x07) << 18) | (uint32_t(u[1] & 0x3F) << 12) | (uint32_t(u[2] & 0x3F) << 6) |
         (u[3] & 0x3F);
}

// The code point that ends at s[end] (exclusive); *len gets its byte length.
inline uint32_t decode_utf8_before(std::string_view s, size_t end, int* len) {
  size_t b = end - 1;
  while (b > 0 && (static_cast<uint8_t>(s[b]) & 0xC0) == 0x80) --b;
  return decode_utf8(s.data() + b, len);
}

inline void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

// Offset of the first byte that breaks UTF-8 validity (overlongs, surrogates and > U+10FFFF
// included), or kNpos when s is valid.
size_t find_invalid_utf8(std::string_view s);

// Rust's String::from_utf8_lossy: each maximal invalid subsequence becomes one U+FFFD.
std::string utf8_lossy(std::string_view bytes);

// Unicode White_Space (Rust char::is_whitespace, regex and Oniguruma \s).
bool is_white_space(uint32_t cp);
// Rust regex's Unicode \w: Alphabetic, Mark, Decimal_Number, Connector_Punctuation, Join_Control.
bool is_word_char(uint32_t cp);
// Rust char::is_numeric: general category Nd, Nl or No.
bool is_numeric(uint32_t cp);
// Rust char::to_lowercase (full, context-free mapping) appended as UTF-8.
void append_lowercase(std::string& out, uint32_t cp);

enum class NormForm { NFC, NFD, NFKC, NFKD };
// Normalizes text; when orig is non-null it holds one entry per byte of text and out_orig gets one
// per byte of out: the entry of the input character each output character came from.
void unicode_normalize(NormForm form, std::string_view text, const uint32_t* orig, std::string& out,
                       std::vector<uint32_t>* out_orig);

// GPT-2's byte-level alphabet: byte b is shown as code point kByteToChar[b].
extern const std::array<uint32_t, 256> kByteToChar;
// The byte a code point of that alphabet stands for, or -1.
int char_to_byte(uint32_t cp);
// Maps a byte-level token ("Ġhello") to its bytes (" hello"); false if a character is outside
// the alphabet.
bool byte_level_to_bytes(std::string_view token, std::string& out);

}  // namespace strata::text::detail
