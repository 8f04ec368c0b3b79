// `strata data`: text, conversations or instructions in, token shards with loss masks and
// document boundaries out (DESIGN.md "Token data"), reproducibly: the same bytes for any thread
// count and across runs. Reads its inputs once, streaming (JSONL line by line, .gz on the fly),
// tokenizes in parallel and writes in input order.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "text/chat.h"
#include "text/tokenizer.h"

namespace strata {

// A model directory's text side: tokenizer.json, and tokenizer_config.json's chat template and
// special tokens.
struct TextModel {
  std::filesystem::path tokenizer_json;
  text::Tokenizer tokenizer;
  text::ChatTemplate chat;
  std::optional<uint32_t> eos_id;  // tokenizer_config.json's eos_token, or the --eos override
  std::string eos_token;
  uint32_t checksum = 0;  // crc32c of tokenizer.json, then tokenizer_config.json if present
};
// `dir` is a model directory holding tokenizer.json (or the tokenizer.json file itself).
// eos_override: a token string that replaces tokenizer_config.json's eos_token. Throws naming
// the file and the fix.
TextModel load_text_model(const std::filesystem::path& dir, const std::string& eos_override = {});

enum class DataFormat { text, chat, instruct };
DataFormat parse_data_format(const std::string& s);  // throws naming the value and the choices
const char* data_format_name(DataFormat f);

struct PrepareOptions {
  std::filesystem::path tokenizer;  // --tokenizer DIR
  std::vector<std::string> inputs;  // --in GLOB, in the order given (each glob sorted)
  DataFormat format = DataFormat::text;
  std::filesystem::path out;        // --out DIR
  int64_t val_docs = 0;             // the first N documents are held out (val_*.bin)
  int64_t shard_tokens = 100'000'000;
  int threads = 0;                  // 0: every core
  bool skip_bad = false;            // count and report malformed records instead of stopping
  std::string eos;                  // --eos TOKEN
  std::string command;              // the command line, recorded in data.json
};

struct PrepareProgress {
  uint64_t input_bytes_done = 0, input_bytes_total = 0;
  int64_t documents = 0, tokens = 0;
  double seconds = 0;
};

struct SplitSummary {
  int64_t documents = 0, tokens = 0, trained_tokens = 0;
  std::vector<std::string> shards;
};

struct PrepareSummary {
  SplitSummary train, val;
  int64_t skipped_bad = 0, skipped_empty = 0;
  int64_t longest_document = 0;  // tokens
  uint64_t input_bytes = 0;
  int shard_version = 1;
  double seconds = 0;
  std::vector<std::string> bad_examples;  // the first few "file:line: why" of skipped records
};

// Thrown by prepare_dataset when SIGINT/SIGTERM/SIGHUP asked the run to stop (src/train/
// stop_signal.h, when the caller installed its handlers): everything it wrote is removed.
struct PrepareInterrupted : std::runtime_error {
  PrepareInterrupted(int sig, const std::string& what) : std::runtime_error(what), signal(sig) {}
  int signal;
};

// Runs the whole preparation; progress (if set) is called from the writing thread about every
// 0.2 s. Throws on bad input (naming file:line and the field) unless skip_bad; the output
// directory then holds no shard of this run.
PrepareSummary prepare_dataset(const PrepareOptions& o, const std::function<void(const PrepareProgress&)>& progress);

// The document of one record, as `strata data` writes it (also `strata tokenize --chat`):
// ids and a 0/1 trained mask of the same length. Throws std::invalid_argument naming the field.
struct Document {
  std::vector<uint32_t> ids;
  std::vector<uint8_t> mask;
  std::string text;  // the rendered text (chat/instruct) or the input text
};
Document make_document(const TextModel& m, DataFormat format, const nlohmann::json* record, std::string_view text,
                       bool keep_text = false);

// The common text record, {"text": "..."} and nothing else, decoded into `out` without building a
// JSON document (the DOM parse costs as much as tokenizing). Anything else, or anything doubtful
// (an escape it does not take, a control character, a lone surrogate), returns false; the caller
// then parses with nlohmann::json, which decodes it the same way or names the error.
bool decode_text_record(std::string_view line, std::string& out);

// Whether an input file is one document (.txt, .md) or one per line (.jsonl), ".gz" looked
// through; any other name throws naming the file and the types taken.
bool input_is_whole_document(const std::filesystem::path& p);

}  // namespace strata
