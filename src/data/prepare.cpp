// `strata data`: see prepare.h. A three-stage TBB pipeline: read records in input order (one
// thread), make documents (parse, render, tokenize: every worker), write them in input order
// (one thread). At most 2 × threads batches are in flight, so memory stays bounded whatever the
// input size.
#include "src/data/prepare.h"

#include <tbb/info.h>
#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>

#include "io/crc32c.h"
#include "src/checkpoint/file_util.h"
#include "src/data/doc_shards.h"
#include "src/data/token_shards.h"
#include "src/train/run_guard.h"
#include "src/train/stop_signal.h"
#include "text/gzip_file.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string where(const fs::path& file, int64_t line) {
  std::string s = file.string();
  if (line > 0) s += ":" + std::to_string(line);
  return s;
}

const json& string_field(const json& rec, const char* name, bool required) {
  static const json kNull;
  auto it = rec.find(name);
  if (it == rec.end() || it->is_null()) {
    if (!required) return kNull;
    throw std::invalid_argument(std::string("no \"") + name + "\" field");
  }
  if (!it->is_string()) throw std::invalid_argument(std::string("\"") + name + "\" is not a string");
  return *it;
}

struct Record {
  int file = 0;
  int64_t line = 0;  // 0 for a whole-file document
  std::string raw;
};

struct Result {
  Document doc;
  std::string error;  // "file:line: why"; doc empty
  bool empty = false;
};

struct Batch {
  std::vector<Record> records;
  std::vector<Result> results;
  uint64_t bytes_done = 0;  // input bytes consumed up to the end of this batch
};

// The reading stage's state: the next record from the list of files.
class RecordReader {
 public:
  explicit RecordReader(const std::vector<fs::path>& files) : files_(files) {}
  // Up to ~1 MiB or 1024 records; nullptr at the end.
  Batch* next_batch() {
    auto b = std::make_unique<Batch>();
    size_t bytes = 0;
    while (bytes < (1u << 20) && b->records.size() < 1024) {
      if (!reader_) {
        if (file_ >= files_.size()) break;
        reader_ = std::make_unique<text::LineReader>(files_[file_]);
        whole_ = input_is_whole_document(files_[file_]);
      }
      Record r;
      r.file = static_cast<int>(file_);
      bool got;
      if (whole_) {
        r.raw = reader_->read_rest();
        got = !done_whole_;
        done_whole_ = true;
      } else {
        got = reader_->next(r.raw);
        r.line = reader_->line_number();
      }
      if (!got) {
        done_bytes_ += reader_->bytes_read();
        reader_.reset();
        done_whole_ = false;
        ++file_;
        continue;
      }
      if (!whole_ && r.raw.find_first_not_of(" \t\r") == std::string::npos) continue;
      bytes += r.raw.size();
      b->records.push_back(std::move(r));
    }
    b->bytes_done = done_bytes_ + (reader_ ? reader_->bytes_read() : 0);
    if (b->records.empty()) return nullptr;
    return b.release();
  }

 private:
  const std::vector<fs::path>& files_;
  size_t file_ = 0;
  std::unique_ptr<text::LineReader> reader_;
  bool whole_ = false;
  bool done_whole_ = false;
  uint64_t done_bytes_ = 0;
};

void mask_from_spans(const std::vector<uint32_t>& starts, const std::vector<std::pair<size_t, size_t>>& spans,
                     std::vector<uint8_t>& mask) {
  mask.assign(starts.size(), 0);
  for (size_t t = 0; t < starts.size(); ++t) {
    const size_t s = starts[t];
    // spans are few and in order; the first span whose end is past s
    auto it = std::upper_bound(spans.begin(), spans.end(), s,
                               [](size_t v, const std::pair<size_t, size_t>& sp) { return v < sp.second; });
    mask[t] = it != spans.end() && it->first <= s;
  }
}

void append_eos(const TextModel& m, Document& d, uint8_t trained) {
  if (!m.eos_id)
    throw std::invalid_argument("the tokenizer has no EOS token (tokenizer_config.json has no eos_token): pass --eos TOKEN");
  const std::vector<uint32_t>& suffix = m.tokenizer.special_suffix();
  if (!suffix.empty() && !d.ids.empty() && d.ids.back() == *m.eos_id) return;  // the post-processor added it
  d.ids.push_back(*m.eos_id);
  d.mask.push_back(trained);
}

}  // namespace

bool input_is_whole_document(const fs::path& p) {
  fs::path name = p.filename();
  if (name.extension() == ".gz") name = name.stem();
  const std::string ext = name.extension().string();
  if (ext == ".txt" || ext == ".md") return true;
  if (ext == ".jsonl") return false;
  std::string msg = p.string();
  msg += ": unknown input type '";
  msg += ext;
  msg += "': .txt or .md files (one document each) and .jsonl files (one document per line), "
         "optionally gzip-compressed (.gz)";
  throw std::runtime_error(msg);
}

// See prepare.h.
bool decode_text_record(std::string_view s, std::string& out) {
  size_t i = 0;
  auto ws = [&] {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\r' || s[i] == '\n')) ++i;
  };
  auto lit = [&](std::string_view t) {
    if (s.substr(i, t.size()) != t) return false;
    i += t.size();
    return true;
  };
  ws();
  if (!lit("{")) return false;
  ws();
  if (!lit("\"text\"")) return false;
  ws();
  if (!lit(":")) return false;
  ws();
  if (!lit("\"")) return false;
  out.clear();
  for (;;) {
    if (i >= s.size()) return false;
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '"') break;
    if (c < 0x20) return false;
    if (c != '\\') {
      const size_t run = s.find_first_of("\"\\", i);
      const size_t end = run == std::string_view::npos ? s.size() : run;
      for (size_t k = i; k < end; ++k)
        if (static_cast<unsigned char>(s[k]) < 0x20) return false;
      out.append(s.data() + i, end - i);
      i = end;
      continue;
    }
    if (i + 1 >= s.size()) return false;
    const char e = s[i + 1];
    i += 2;
    switch (e) {
      case '"': out += '"'; break;
      case '\\': out += '\\'; break;
      case '/': out += '/'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'u': {
        auto hex4 = [&](uint32_t& v) {
          if (i + 4 > s.size()) return false;
          v = 0;
          for (size_t k = 0; k < 4; ++k) {
            const char h = s[i + k];
            v <<= 4;
            if (h >= '0' && h <= '9') v |= static_cast<uint32_t>(h - '0');
            else if (h >= 'a' && h <= 'f') v |= static_cast<uint32_t>(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F') v |= static_cast<uint32_t>(h - 'A' + 10);
            else return false;
          }
          i += 4;
          return true;
        };
        uint32_t cp;
        if (!hex4(cp)) return false;
        if (cp >= 0xDC00 && cp <= 0xDFFF) return false;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          uint32_t lo;
          if (!lit("\\u") || !hex4(lo) || lo < 0xDC00 || lo > 0xDFFF) return false;
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        }
        if (cp < 0x80) {
          out += static_cast<char>(cp);
        } else if (cp < 0x800) {
          out += static_cast<char>(0xC0 | (cp >> 6));
          out += static_cast<char>(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
          out += static_cast<char>(0xE0 | (cp >> 12));
          out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
          out += static_cast<char>(0x80 | (cp & 0x3F));
        } else {
          out += static_cast<char>(0xF0 | (cp >> 18));
          out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
          out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
          out += static_cast<char>(0x80 | (cp & 0x3F));
        }
        break;
      }
      default: return false;
    }
  }
  ++i;  // the closing quote
  ws();
  if (!lit("}")) return false;
  ws();
  return i == s.size();
}

DataFormat parse_data_format(const std::string& s) {
  if (s == "text") return DataFormat::text;
  if (s == "chat") return DataFormat::chat;
  if (s == "instruct") return DataFormat::instruct;
  throw std::invalid_argument("--format " + s + ": expected text, chat or instruct");
}

const char* data_format_name(DataFormat f) {
  return f == DataFormat::text ? "text" : f == DataFormat::chat ? "chat" : "instruct";
}

TextModel load_text_model(const fs::path& dir, const std::string& eos_override) {
  fs::path json_path = dir / "tokenizer.json";
  fs::path model_dir = dir;
  std::error_code ec;
  if (fs::is_regular_file(dir, ec)) {
    json_path = dir;
    model_dir = dir.parent_path().empty() ? fs::path(".") : dir.parent_path();
  } else if (!fs::exists(dir, ec)) {
    throw std::runtime_error("--tokenizer " + dir.string() + ": no such file or directory");
  } else if (!fs::exists(json_path, ec)) {
    throw std::runtime_error("--tokenizer " + dir.string() +
                             ": no tokenizer.json there (a Hugging Face model directory holds tokenizer.json and, "
                             "for chat templates and special tokens, tokenizer_config.json)");
  }
  const std::string json_text = text::read_text_file(json_path);  // parsed and checksummed from one read
  TextModel m{json_path, text::Tokenizer::from_json(std::string_view(json_text), json_path.string()),
              text::ChatTemplate::from_model_dir(model_dir), {}, {}, io::crc32c(json_text.data(), json_text.size())};
  if (fs::exists(model_dir / "tokenizer_config.json", ec)) {
    const std::string config = text::read_text_file(model_dir / "tokenizer_config.json");
    m.checksum = io::crc32c(config.data(), config.size(), m.checksum);
  }
  m.eos_token = eos_override.empty() ? m.chat.eos_token() : eos_override;
  if (!m.eos_token.empty()) {
    m.eos_id = m.tokenizer.token_to_id(m.eos_token);
    if (!m.eos_id)
      throw std::runtime_error(std::string(eos_override.empty() ? "tokenizer_config.json's eos_token" : "--eos") + " '" +
                               m.eos_token + "' is not a token of " + json_path.string());
  }
  return m;
}

Document make_document(const TextModel& m, DataFormat format, const json* record, std::string_view text_in,
                       bool keep_text) {
  Document d;
  std::vector<uint32_t> starts;
  text::ChatTemplate::Rendered r;
  bool alpaca = false;
  if (format == DataFormat::text) {
    std::string_view t = text_in;
    if (record) t = string_field(*record, "text", true).get_ref<const std::string&>();
    d.ids = m.tokenizer.encode(t, true);
    d.mask.assign(d.ids.size(), 1);
    append_eos(m, d, 1);
    if (keep_text) d.text = t;
    return d;
  }
  if (!record) throw std::invalid_argument("--format chat and instruct read .jsonl records, not whole text files");
  if (!record->is_object()) throw std::invalid_argument("the line is not a JSON object");
  if (format == DataFormat::chat) {
    if (!m.chat.has_template()) throw std::invalid_argument("the tokenizer has no chat template (tokenizer_config.json)");
    r = m.chat.render_conversation(text::conversation_messages(*record));
  } else {
    const std::string& instruction = string_field(*record, "instruction", true).get_ref<const std::string&>();
    const json& input = string_field(*record, "input", false);
    const std::string& output = string_field(*record, "output", true).get_ref<const std::string&>();
    r = m.chat.render_instruct(instruction, input.is_string() ? input.get_ref<const std::string&>() : std::string(),
                               output);
    alpaca = !m.chat.has_template();
  }
  // A template's rendering is the document exactly; the Alpaca prompt is plain text, so it gets
  // the post-processor's tokens and a trained EOS like a text document.
  m.tokenizer.encode_with_offsets(r.text, alpaca, d.ids, starts);
  mask_from_spans(starts, r.trained, d.mask);
  if (alpaca) append_eos(m, d, 1);
  if (keep_text) d.text = std::move(r.text);
  return d;
}

PrepareSummary prepare_dataset(const PrepareOptions& o, const std::function<void(const PrepareProgress&)>& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  if (o.inputs.empty()) throw std::invalid_argument("give at least one --in FILE or GLOB");
  if (o.val_docs < 0) throw std::invalid_argument("--val-docs must be >= 0");
  const TextModel m = load_text_model(o.tokenizer, o.eos);
  if (o.format == DataFormat::chat && !m.chat.has_template())
    throw std::runtime_error("--format chat needs a chat template, and " + o.tokenizer.string() +
                             " has none (no chat_template in tokenizer_config.json, no chat_template.jinja)");
  if (o.format == DataFormat::text && !m.eos_id)
    throw std::runtime_error(o.tokenizer.string() +
                             ": no eos_token in tokenizer_config.json, and text documents end with EOS: pass --eos TOKEN");

  std::vector<fs::path> files;
  PrepareSummary sum;
  for (const std::string& g : o.inputs) {
    for (const fs::path& p : expand_glob(g)) {
      input_is_whole_document(p);  // an unknown type is refused before anything is read
      uint64_t size = 0;
      open_regular_file(p, &size);
      sum.input_bytes += size;
      files.push_back(p);
    }
  }

  // The output directory: locked for the run, never holding another data set.
  std::error_code ec;
  fs::create_directories(o.out, ec);
  if (ec) throw std::runtime_error("--out " + o.out.string() + ": cannot create the directory: " + ec.message());
  PathLock lock = PathLock::acquire(dir_lock_file(o.out), "--out " + o.out.string(), true);
  for (const fs::directory_entry& e : fs::directory_iterator(o.out)) {
    const std::string name = e.path().filename().string();
    const std::string ext = e.path().extension().string();
    if (name == "data.json" || ext == ".bin" || ext == ".mask" || ext == ".docs") {
      const bool finished = fs::exists(o.out / "data.json", ec);
      throw std::runtime_error("--out " + o.out.string() +
                               (finished ? " already holds a data set (" + name + ")"
                                         : " holds shards of a `strata data` run that did not finish (" + name +
                                               ", no data.json)") +
                               ": give another --out, or remove its files first");
    }
  }
  for (const fs::directory_entry& e : fs::directory_iterator(o.out))
    if (e.path().extension() == ".partial") fs::remove(e.path(), ec);  // a killed run's; we hold the lock

  sum.shard_version = m.tokenizer.vocab_size() <= 65536 ? 1 : 7;
  ShardSetWriter train(o.out, "train", o.shard_tokens, sum.shard_version);
  std::unique_ptr<ShardSetWriter> val;
  if (o.val_docs > 0) val = std::make_unique<ShardSetWriter>(o.out, "val", o.shard_tokens, sum.shard_version);

  const int threads = o.threads > 0 ? o.threads : tbb::info::default_concurrency();
  RecordReader reader(files);
  PrepareProgress prog;
  prog.input_bytes_total = sum.input_bytes;
  double last_report = -1;
  tbb::task_arena arena(threads);
  try {
  arena.execute([&] {
    tbb::parallel_pipeline(
        static_cast<size_t>(2 * threads),
        tbb::make_filter<void, Batch*>(tbb::filter_mode::serial_in_order,
                                       [&](tbb::flow_control& fc) -> Batch* {
                                         if (const int sig = stop_requested())
                                           throw PrepareInterrupted(
                                               sig, "stopped by signal " + std::to_string(sig) +
                                                        ": the shards of this run were removed, --out holds none");
                                         Batch* b = reader.next_batch();
                                         if (!b) fc.stop();
                                         return b;
                                       }) &
            tbb::make_filter<Batch*, Batch*>(tbb::filter_mode::parallel,
                                             [&](Batch* b) {
                                               b->results.resize(b->records.size());
                                               for (size_t i = 0; i < b->records.size(); ++i) {
                                                 Record& rec = b->records[i];
                                                 Result& res = b->results[i];
                                                 try {
                                                   if (rec.line == 0) {
                                                     if (o.format != DataFormat::text)
                                                       throw std::invalid_argument(
                                                           "--format chat and instruct read .jsonl files, one record "
                                                           "per line; a .txt file is a text document");
                                                     res.empty = rec.raw.empty();
                                                     if (!res.empty) res.doc = make_document(m, o.format, nullptr, rec.raw);
                                                   } else {
                                                     std::string text_field;
                                                     if (o.format == DataFormat::text && decode_text_record(rec.raw, text_field)) {
                                                       res.empty = text_field.empty();
                                                       if (!res.empty) res.doc = make_document(m, o.format, nullptr, text_field);
                                                       std::string().swap(rec.raw);
                                                       continue;
                                                     }
                                                     json j;
                                                     try {
                                                       j = json::parse(rec.raw);
                                                     } catch (const json::parse_error& e) {
                                                       throw std::invalid_argument(std::string("not valid JSON: ") + e.what());
                                                     }
                                                     if (!j.is_object())
                                                       throw std::invalid_argument("the line is not a JSON object");
                                                     if (o.format == DataFormat::text) {
                                                       res.empty = string_field(j, "text", true).get_ref<const std::string&>().empty();
                                                       if (res.empty) continue;
                                                     }
                                                     res.doc = make_document(m, o.format, &j, {});
                                                   }
                                                 } catch (const std::exception& e) {
                                                   res.error = where(files[static_cast<size_t>(rec.file)], rec.line) + ": " + e.what();
                                                 }
                                                 std::string().swap(rec.raw);
                                               }
                                               return b;
                                             }) &
            tbb::make_filter<Batch*, void>(tbb::filter_mode::serial_in_order, [&](Batch* b) {
              std::unique_ptr<Batch> own(b);
              for (Result& res : b->results) {
                if (!res.error.empty()) {
                  if (!o.skip_bad) throw std::runtime_error(res.error + " (--skip-bad counts such records and goes on)");
                  ++sum.skipped_bad;
                  if (sum.bad_examples.size() < 5) sum.bad_examples.push_back(res.error);
                  continue;
                }
                if (res.empty) {
                  ++sum.skipped_empty;
                  continue;
                }
                const Document& d = res.doc;
                int64_t trained = 0;
                for (uint8_t v : d.mask) trained += v;
                const bool to_val = val && val->documents() < o.val_docs;
                SplitSummary& split = to_val ? sum.val : sum.train;
                (to_val ? *val : train).add_document(d.ids.data(), d.mask.data(), d.ids.size());
                split.documents += 1;
                split.tokens += static_cast<int64_t>(d.ids.size());
                split.trained_tokens += trained;
                sum.longest_document = std::max<int64_t>(sum.longest_document, static_cast<int64_t>(d.ids.size()));
              }
              prog.input_bytes_done = b->bytes_done;
              prog.documents = sum.train.documents + sum.val.documents;
              prog.tokens = sum.train.tokens + sum.val.tokens;
              prog.seconds = elapsed();
              if (progress && prog.seconds - last_report >= 0.2) {
                last_report = prog.seconds;
                progress(prog);
              }
            }));
  });
  if (sum.train.documents + sum.val.documents == 0)
    throw std::runtime_error("no documents in the input (" + std::to_string(sum.skipped_empty) + " empty, " +
                             std::to_string(sum.skipped_bad) + " malformed): nothing written");
  if (o.val_docs > 0 && sum.train.documents == 0)
    throw std::runtime_error("--val-docs " + std::to_string(o.val_docs) + " holds out all " +
                             std::to_string(sum.val.documents) + " documents and none is left to train on: lower it");
  sum.train.shards = train.finish();
  if (val) sum.val.shards = val->finish();
  } catch (...) {
    // Nothing of a failed run stays: no shard without its data.json.
    train.abandon();
    if (val) val->abandon();
    throw;
  }
  sum.seconds = elapsed();

  json split_json = json::object();
  auto put_split = [&](const char* name, const SplitSummary& s) {
    split_json[name] = {{"documents", s.documents}, {"tokens", s.tokens}, {"trained_tokens", s.trained_tokens},
                        {"shards", s.shards}};
  };
  put_split("train", sum.train);
  if (val) put_split("val", sum.val);
  char crc[16];
  std::snprintf(crc, sizeof(crc), "%08x", m.checksum);
  json inputs = json::array();
  for (const fs::path& p : files) inputs.push_back(p.string());
  json dj = {{"strata_data_version", 1},
             {"format", data_format_name(o.format)},
             {"tokenizer", {{"path", fs::absolute(m.tokenizer_json).lexically_normal().string()},
                            {"crc32c", crc},
                            {"vocab_size", m.tokenizer.vocab_size()},
                            {"eos_token", m.eos_token},
                            {"eos_id", m.eos_id ? json(*m.eos_id) : json(nullptr)},
                            {"special_prefix", m.tokenizer.special_prefix()},
                            {"special_suffix", m.tokenizer.special_suffix()}}},
             {"shard_version", sum.shard_version},
             {"shard_tokens", o.shard_tokens},
             {"val_docs", o.val_docs},
             {"splits", split_json},
             {"longest_document", sum.longest_document},
             {"skipped_bad", sum.skipped_bad},
             {"skipped_empty", sum.skipped_empty},
             {"inputs", inputs},
             {"input_bytes", sum.input_bytes},
             {"command", o.command}};
  const fs::path tmp = o.out / "data.json.partial";
  write_file_synced(tmp, dj.dump(2) + "\n");
  fs::rename(tmp, o.out / "data.json");
  fsync_dir(o.out);
  return sum;
}

}  // namespace strata
