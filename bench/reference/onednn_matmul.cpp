// The bare oneDNN reference: one matmul primitive built once, executed on its own stream.
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>

#include "bench/reference/reference.h"

namespace strata::bench_ref {

struct OnednnMatmul::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  dnnl::memory::desc a, b, c;
  dnnl::matmul prim;
  std::string impl;
};

OnednnMatmul::OnednnMatmul(int64_t m, int64_t n, int64_t k, bool bf16) : impl_(std::make_unique<Impl>()) {
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  const dt in = bf16 ? dt::bf16 : dt::f32;
  impl_->a = dnnl::memory::desc({m, k}, in, tag::ab);
  impl_->b = dnnl::memory::desc({k, n}, in, tag::ab);
  impl_->c = dnnl::memory::desc({m, n}, dt::f32, tag::ab);
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(impl_->a, impl_->b, impl_->c), impl_->engine);
  impl_->impl = pd.impl_info_str();
  impl_->prim = dnnl::matmul(pd);
}
OnednnMatmul::~OnednnMatmul() = default;

void OnednnMatmul::run(const void* a, const void* b, float* c) {
  dnnl::memory am(impl_->a, impl_->engine, const_cast<void*>(a));
  dnnl::memory bm(impl_->b, impl_->engine, const_cast<void*>(b));
  dnnl::memory cm(impl_->c, impl_->engine, c);
  impl_->prim.execute(impl_->stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  impl_->stream.wait();
}

const char* OnednnMatmul::impl() const { return impl_->impl.c_str(); }

}  // namespace strata::bench_ref
