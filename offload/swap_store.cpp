// The NvmeStore over io/: a SwapSpace extent, sub-range I/O through the space's IoEngine. A read
// that fails checksum verification is reported with the name of the block that owns the bytes.
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "io/aligned_buffer.h"
#include "io/swap_space.h"
#include "offload/nvme_store.h"

namespace strata::offload {

void NvmeStore::zero(uint64_t offset, uint64_t length) {
  if (length == 0) return;
  io::AlignedBuffer zeros(static_cast<size_t>(std::min<uint64_t>(length, uint64_t{4} << 20)));
  std::memset(zeros.data(), 0, zeros.size());
  for (uint64_t done = 0; done < length; done += zeros.size())
    write(offset + done, std::min<uint64_t>(zeros.size(), length - done), zeros.data())->wait();
}

namespace {

// Block names by store offset (name_range), looked up only when a read fails verification.
class RangeNames {
 public:
  void add(uint64_t offset, uint64_t bytes, const std::string& name) {
    std::lock_guard lk(mu_);
    names_[offset] = {bytes, name};
  }
  std::string describe(uint64_t offset) const {
    std::lock_guard lk(mu_);
    auto it = names_.upper_bound(offset);
    if (it == names_.begin()) return "";
    --it;
    if (offset >= it->first + it->second.first) return "";
    return "offload block '" + it->second.second + "' at byte " + std::to_string(offset - it->first);
  }

 private:
  mutable std::mutex mu_;
  std::map<uint64_t, std::pair<uint64_t, std::string>> names_;  // offset -> (bytes, name)
};

class IoPart final : public Waitable {
 public:
  IoPart(io::IoHandle h, const RangeNames* names) : h_(std::move(h)), names_(names) {}
  void wait() override {
    if (!names_) return h_.wait();
    try {
      h_.wait();
    } catch (const io::ChecksumError& e) {
      // The extent is the whole store, so the extent offset is the store offset.
      const std::string block = names_->describe(e.extent_offset());
      if (block.empty()) throw;
      throw e.with_context(block);
    }
  }
  bool ready() override { return h_.ready(); }

 private:
  io::IoHandle h_;
  const RangeNames* names_;  // reads only
};

class SwapStore final : public NvmeStore {
 public:
  SwapStore(io::SwapSpace& space, uint64_t bytes) : space_(space), extent_(space.allocate(bytes)) {}
  ~SwapStore() override {
    space_.engine().drain();
    space_.free(extent_);
  }
  uint64_t capacity() const override { return extent_.bytes; }
  std::shared_ptr<Waitable> read(uint64_t offset, uint64_t length, void* buf) override {
    return std::make_shared<IoPart>(space_.read(extent_, offset, length, buf), &names_);
  }
  std::shared_ptr<Waitable> write(uint64_t offset, uint64_t length, const void* buf) override {
    return std::make_shared<IoPart>(space_.write(extent_, offset, length, buf), nullptr);
  }
  void zero(uint64_t offset, uint64_t length) override { space_.zero(extent_, offset, length); }
  void register_buffer(void* p, size_t bytes) override { space_.engine().register_buffer(p, bytes); }
  void unregister_buffer(void* p) override { space_.engine().unregister_buffer(p); }
  void name_range(uint64_t offset, uint64_t bytes, const std::string& name) override { names_.add(offset, bytes, name); }

 private:
  RangeNames names_;
  io::SwapSpace& space_;
  io::Extent extent_;
};

}  // namespace

std::unique_ptr<NvmeStore> make_swap_store(io::SwapSpace& space, uint64_t bytes) {
  return std::make_unique<SwapStore>(space, bytes);
}

}  // namespace strata::offload
