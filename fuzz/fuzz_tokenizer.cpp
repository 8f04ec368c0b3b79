// libFuzzer: tokenizer.json is data from a model directory and text is anything a user feeds
// `strata data`, so neither may crash, hang or grow memory without bound. The first byte picks:
//   0: the rest is a tokenizer.json; if it loads, it encodes and decodes a fixed mixed text;
//   1: the rest is text for the byte-level `bytes` fixture: valid UTF-8 must round-trip exactly
//      (decode(encode(x)) == x), and the offsets must be in order and inside the text;
//   2: the rest is text for Llama-2's SentencePiece-style BPE (byte fallback): encode and decode.
// Invalid UTF-8 must be an std::invalid_argument, never a crash.
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "text/gzip_file.h"
#include "text/tokenizer.h"

using strata::text::Tokenizer;

namespace {

const Tokenizer& fixture(const char* rel) {
  const std::string path = std::string(STRATA_SOURCE_DIR) + "/tests/text/fixtures/tokenizers/" + rel;
  return *new Tokenizer(Tokenizer::from_json(strata::text::read_text_file(path), path));  // lives for the run
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Tokenizer& bytes = fixture("bytes/tokenizer.json");
  static const Tokenizer& llama2 = fixture("llama2/tokenizer.json.gz");
  if (size == 0) return 0;
  const std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    if (data[0] % 3 == 0) {
      const Tokenizer t = Tokenizer::from_json(in, "fuzz.json");
      const auto ids = t.encode("Hello world, it's 12345 \xC3\xA9t\xC3\xA9 \xF0\x9F\x98\x80 <s>", true);
      (void)t.decode(ids, false);
      (void)t.decode(ids, true);
    } else if (data[0] % 3 == 1) {
      std::vector<uint32_t> ids, starts;
      bytes.encode_with_offsets(in, false, ids, starts);
      if (ids.size() != starts.size()) std::abort();
      for (size_t i = 0; i < starts.size(); ++i)
        if (starts[i] > in.size() || (i > 0 && starts[i] < starts[i - 1])) std::abort();
      if (bytes.decode(ids, false) != in) std::abort();  // byte-level: every text round-trips
    } else {
      const auto ids = llama2.encode(in, true);
      (void)llama2.decode(ids, true);
    }
  } catch (const std::invalid_argument&) {
  } catch (const std::runtime_error&) {
  }
  return 0;
}
