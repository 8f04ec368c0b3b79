// The NvmeStore over io/: a SwapSpace extent, sub-range I/O through the space's IoEngine.
#include <string>

#include "io/swap_space.h"
#include "offload/nvme_store.h"

namespace strata::offload {
namespace {

class IoPart final : public Waitable {
 public:
  explicit IoPart(io::IoHandle h) : h_(std::move(h)) {}
  void wait() override { h_.wait(); }
  bool ready() override { return h_.ready(); }

 private:
  io::IoHandle h_;
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
    return std::make_shared<IoPart>(space_.read(extent_, offset, length, buf));
  }
  std::shared_ptr<Waitable> write(uint64_t offset, uint64_t length, const void* buf) override {
    return std::make_shared<IoPart>(space_.write(extent_, offset, length, buf));
  }
  void register_buffer(void* p, size_t bytes) override { space_.engine().register_buffer(p, bytes); }
  void unregister_buffer(void* p) override { space_.engine().unregister_buffer(p); }

 private:
  io::SwapSpace& space_;
  io::Extent extent_;
};

}  // namespace

std::unique_ptr<NvmeStore> make_swap_store(io::SwapSpace& space, uint64_t bytes) {
  return std::make_unique<SwapStore>(space, bytes);
}

}  // namespace strata::offload
