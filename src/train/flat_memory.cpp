// FlatMemory: offsets into whole-model buffers.
#include "src/train/flat_memory.h"

#include <stdexcept>

#include "src/model/linear.h"

namespace strata {

FlatMemory::FlatMemory(Transformer& model, kernels::Runtime& rt) : model_(model), rt_(rt) {
  stream_ = rt.create_stream();
  const size_t flat = static_cast<size_t>(model.n_flat());
  auto alloc = [&](kernels::DeviceBuffer& b, size_t bytes) {
    b = kernels::DeviceBuffer(rt, std::max<size_t>(bytes, 64));
    stream_->memset_async(b.data(), 0, b.bytes());
  };
  alloc(master_, flat * 4);
  if (model.dtype() != DType::f32) alloc(working_, flat * kernels::dtype_size(model.dtype()));
  alloc(grads_, flat * 4);
  alloc(adam_, flat * 8);
  alloc(inputs_, model.input_bytes() * static_cast<size_t>(std::max<int64_t>(model.dims().L, 1)));
  alloc(workspace_, model.workspace_bytes());
  model.bind_workspace(*stream_, workspace_.data());
  stream_->synchronize();
}

void* FlatMemory::acquire(Role r, int index, offload::Mode, Side) {
  const auto& units = model_.units();
  auto unit_offset = [&] { return units.at(static_cast<size_t>(index)).offset; };
  switch (r) {
    case Role::weights: return model_detail::at(weights(), unit_offset(), model_.dtype());
    case Role::master: return master() + unit_offset();
    case Role::adam: return adam_.as<float>() + 2 * unit_offset();
    case Role::grads: return grads() + unit_offset();
    case Role::input: return inputs_.as<char>() + model_.input_bytes() * static_cast<size_t>(index);
  }
  throw std::logic_error("FlatMemory: unknown role");
}

void FlatMemory::sync_weights() {
  if (!working_.data()) return;
  rt_.ops().cast(*stream_, {.n = model_.n_flat(), .src = master(), .src_dtype = DType::f32, .dst = working_.data(),
                            .dst_dtype = model_.dtype()});
}

void FlatMemory::zero_grads() { stream_->memset_async(grads_.data(), 0, grads_.bytes()); }

}  // namespace strata
