#include "text/gzip_file.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace strata::text {
namespace {

bool is_gzip_name(const std::filesystem::path& p) { return p.extension() == ".gz"; }

std::runtime_error file_error(const std::filesystem::path& p, const std::string& what) {
  std::string msg = p.string();
  msg += ": ";
  msg += what;
  return std::runtime_error(msg);
}

}  // namespace

// A plain fd or a zlib inflate stream over one (gzip, also several concatenated members).
struct LineReader::Impl {
  int fd = -1;
  bool gz = false;
  z_stream zs{};
  bool zs_ready = false;
  bool stream_end = false;
  std::string in;  // compressed input buffer
  ~Impl() {
    if (zs_ready) inflateEnd(&zs);
    if (fd >= 0) ::close(fd);
  }
};

LineReader::LineReader(const std::filesystem::path& path) : path_(path), impl_(std::make_unique<Impl>()) {
  impl_->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (impl_->fd < 0) throw file_error(path, std::string("cannot open: ") + std::strerror(errno));
  impl_->gz = is_gzip_name(path);
  if (impl_->gz) {
    if (inflateInit2(&impl_->zs, 15 + 32) != Z_OK) throw file_error(path, "zlib inflateInit2 failed");
    impl_->zs_ready = true;
    impl_->in.resize(1 << 16);
  }
}

LineReader::~LineReader() = default;

// Appends more decompressed bytes to buf_; false at the end of the file.
bool LineReader::fill() {
  constexpr size_t kChunk = 1 << 18;
  Impl& im = *impl_;
  if (!im.gz) {
    size_t old = buf_.size();
    buf_.resize(old + kChunk);
    ssize_t n;
    do {
      n = ::read(im.fd, buf_.data() + old, kChunk);
    } while (n < 0 && errno == EINTR);
    if (n < 0) throw file_error(path_, std::string("read failed: ") + std::strerror(errno));
    buf_.resize(old + static_cast<size_t>(n));
    raw_bytes_ += static_cast<uint64_t>(n);
    return n > 0;
  }
  size_t old = buf_.size();
  buf_.resize(old + kChunk);
  im.zs.next_out = reinterpret_cast<Bytef*>(buf_.data() + old);
  im.zs.avail_out = static_cast<uInt>(kChunk);
  while (im.zs.avail_out == kChunk) {
    if (im.zs.avail_in == 0) {
      ssize_t n;
      do {
        n = ::read(im.fd, im.in.data(), im.in.size());
      } while (n < 0 && errno == EINTR);
      if (n < 0) throw file_error(path_, std::string("read failed: ") + std::strerror(errno));
      if (n == 0) {
        if (!im.stream_end) throw file_error(path_, "the gzip stream ends early (a truncated .gz file)");
        break;
      }
      raw_bytes_ += static_cast<uint64_t>(n);
      im.zs.next_in = reinterpret_cast<Bytef*>(im.in.data());
      im.zs.avail_in = static_cast<uInt>(n);
    }
    if (im.stream_end) {  // another gzip member follows the one that ended
      if (inflateReset(&im.zs) != Z_OK) throw file_error(path_, "zlib inflateReset failed");
      im.stream_end = false;
    }
    int rc = inflate(&im.zs, Z_NO_FLUSH);
    if (rc == Z_STREAM_END) {
      im.stream_end = true;
    } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
      std::string what = "not a valid gzip file (zlib: ";
      what += im.zs.msg ? im.zs.msg : "error " + std::to_string(rc);
      what += ")";
      throw file_error(path_, what);
    }
  }
  size_t produced = kChunk - im.zs.avail_out;
  buf_.resize(old + produced);
  return produced > 0;
}

bool LineReader::next(std::string& line) {
  for (;;) {
    size_t nl = buf_.find('\n', pos_);
    if (nl != std::string::npos) {
      line.assign(buf_, pos_, nl - pos_);
      pos_ = nl + 1;
      ++line_no_;
      return true;
    }
    if (eof_) {
      if (pos_ >= buf_.size()) return false;
      line.assign(buf_, pos_, std::string::npos);
      pos_ = buf_.size();
      ++line_no_;
      return true;
    }
    if (pos_ > 0) {
      buf_.erase(0, pos_);
      pos_ = 0;
    }
    if (!fill()) eof_ = true;
  }
}

std::string LineReader::read_rest() {
  while (!eof_) {
    if (!fill()) eof_ = true;
  }
  std::string out = buf_.substr(pos_);
  pos_ = buf_.size();
  return out;
}

std::string read_text_file(const std::filesystem::path& path) {
  LineReader r(path);
  return r.read_rest();
}

}  // namespace strata::text
