// Reading text files that may be gzip-compressed (a name ending in ".gz"): whole, or line by
// line with the line number, for `strata data`'s inputs and the test fixtures.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

namespace strata::text {

// The whole file, decompressed when its name ends in ".gz". Throws naming the file.
std::string read_text_file(const std::filesystem::path& path);

// Streams a file (".gz" decompressed) line by line without holding it whole. A line is the bytes
// up to '\n' (not included; a '\r' before it is kept); a last line without '\n' counts.
class LineReader {
 public:
  explicit LineReader(const std::filesystem::path& path);
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;
  // The next line into `line`; false at the end. Throws naming the file on a read or gzip error.
  bool next(std::string& line);
  // Everything not yet returned, exactly (for reading a whole file).
  std::string read_rest();
  int64_t line_number() const { return line_no_; }     // of the line last returned, from 1
  uint64_t bytes_read() const { return raw_bytes_; }    // compressed bytes consumed so far
  const std::filesystem::path& path() const { return path_; }

 private:
  bool fill();
  std::filesystem::path path_;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string buf_;
  size_t pos_ = 0;
  bool eof_ = false;
  int64_t line_no_ = 0;
  uint64_t raw_bytes_ = 0;
};

}  // namespace strata::text
