// The one-rank communicator: every collective is the identity, so in-place calls do nothing
// and out-of-place calls are one stream-ordered copy. Used whenever strata is not under mpirun.
#include <cstring>

#include "src/comm/comm_internal.h"

namespace strata {
namespace {

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator() : Communicator(CommBackend::local, 0, 1, 0, 1) {}

 protected:
  void do_all_gather(const void* send, void* recv, size_t n, DType t, kernels::Stream& s) override {
    copy(send, recv, n * kernels::dtype_size(t), s);
  }
  void do_reduce_scatter(const void* send, void* recv, size_t n, DType t, kernels::Stream& s) override {
    copy(send, recv, n * kernels::dtype_size(t), s);  // the sum of one contribution is itself
  }
  void do_all_reduce(const void* send, void* recv, size_t n, DType t, kernels::Stream& s) override {
    copy(send, recv, n * kernels::dtype_size(t), s);
  }
  void do_broadcast(void*, size_t, DType, int, kernels::Stream&) override {}
  void do_barrier(kernels::Stream&) override {}
  void do_send(const void*, size_t, DType, int, kernels::Stream&) override {}  // (no peer: refused above)
  void do_recv(void*, size_t, DType, int, kernels::Stream&) override {}
  void do_send_recv(const void*, size_t, int, void*, size_t, int, DType, kernels::Stream&) override {}
  void do_host_broadcast(void*, size_t, int) override {}
  void do_host_all_gather(const void* send, void* recv, size_t n_bytes) override {
    if (send != recv && n_bytes > 0) std::memmove(recv, send, n_bytes);
  }
  void do_host_gather(const void* send, void* recv, size_t n_bytes, int) override {
    std::memcpy(recv, send, n_bytes);  // (validated: no overlap)
  }
  std::unique_ptr<Communicator> do_split(int, int) override { return std::make_unique<LocalCommunicator>(); }

 private:
  static void copy(const void* send, void* recv, size_t bytes, kernels::Stream& s) {
    if (send != recv && bytes > 0) s.memcpy_async(recv, send, bytes);
  }
};

}  // namespace

namespace comm_detail {
std::unique_ptr<Communicator> make_local() { return std::make_unique<LocalCommunicator>(); }
}  // namespace comm_detail

}  // namespace strata
