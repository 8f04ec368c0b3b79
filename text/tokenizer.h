// Hugging Face tokenizer.json (BPE models) in native code: encode, decode, added tokens and the
// post-processor, giving exactly the ids of the Rust `tokenizers` library (0.22). Anything the file
// asks for that is not implemented is refused at load, naming the component. The file's
// "truncation" and "padding" are encode options, not tokenization, and are not applied.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace strata::text {

namespace detail {
struct TokenizerImpl;
}

class Tokenizer {
 public:
  // Throws std::runtime_error naming the file and the component for anything unsupported
  // (e.g. "tokenizer.json: pre_tokenizer type 'Whitespace' is not supported"), never a silently
  // different tokenization. A name ending in ".gz" is decompressed.
  static Tokenizer from_file(const std::filesystem::path& tokenizer_json);
  static Tokenizer from_json(std::string_view json_text, std::string source_name);
  static Tokenizer from_json(const nlohmann::json& j, std::string source_name);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Ids of text. Added tokens are matched first, then normalizer, pre-tokenizer, model.
  // add_special: apply the post-processor (TemplateProcessing BOS/EOS; ByteLevel is a no-op for ids).
  // Throws std::invalid_argument when text is not valid UTF-8 (the Rust library only takes &str).
  std::vector<uint32_t> encode(std::string_view text, bool add_special = false) const;
  // Same, plus for each id the byte offset in `text` of the token's first character (a token that
  // starts inside a multi-byte character gets that character's start). A token added by the
  // post-processor gets 0 if prepended, text.size() if appended; bytes a normalizer inserted map
  // to the original character they were derived from. Used for loss masks. Two known differences
  // from the Rust offsets: a ByteLevel post-processor's trim_offsets is not applied (the start stays
  // on the token's first character, its leading space included), and after NFC/NFKC a run of
  // several reordered combining marks on a decomposable base may map one mark to a neighbour.
  void encode_with_offsets(std::string_view text, bool add_special, std::vector<uint32_t>& ids,
                           std::vector<uint32_t>& starts) const;
  // Many documents in parallel (TBB, `threads` workers, 0 = all cores); output identical for any
  // thread count.
  std::vector<std::vector<uint32_t>> encode_batch(const std::vector<std::string_view>& texts,
                                                  bool add_special, int threads) const;
  // Text of ids through the decoder (unknown ids are dropped, as in the Rust library).
  std::string decode(std::span<const uint32_t> ids, bool skip_special_tokens = false) const;

  uint32_t vocab_size() const;  // 1 + the largest id of the model's vocab and the added tokens
  std::optional<uint32_t> token_to_id(std::string_view token) const;  // vocab or added token
  std::optional<std::string> id_to_token(uint32_t id) const;
  bool is_special(uint32_t id) const;
  // The ids the post-processor puts before / after a single sequence (e.g. {<|begin_of_text|>} / {}).
  const std::vector<uint32_t>& special_prefix() const;
  const std::vector<uint32_t>& special_suffix() const;

 private:
  explicit Tokenizer(std::unique_ptr<detail::TokenizerImpl> impl);
  std::unique_ptr<detail::TokenizerImpl> impl_;
};

}  // namespace strata::text
