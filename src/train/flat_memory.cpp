// FlatMemory: offsets into whole-model buffers.
#include "src/train/flat_memory.h"

#include <algorithm>
#include <stdexcept>

namespace strata {

FlatMemory::FlatMemory(Transformer& model, kernels::Runtime& rt)
    : model_(model), rt_(rt), units_(model, Placement{}) {
  stream_ = rt.create_stream();
  // Each state's blocks back to back in unit order: byte offsets, and the buffer's size. Frozen
  // units (LoRA's base) get their place too, so every parameter has its flat offset in master()
  // and grads() (a frozen unit's grads are never written).
  const UnitTable all(model, Placement{}, std::vector<bool>(model.units().size(), true));
  std::array<size_t, kNumRoles> total{};
  for (Role r : {Role::params, Role::master, Role::adam, Role::grads})
    for (size_t u = 0; u < all.size(); ++u) {
      auto& t = total[static_cast<size_t>(r)];
      at_[static_cast<size_t>(r)].push_back(t);
      t += all.bytes(r, static_cast<int>(u));
    }
  auto alloc = [&](kernels::DeviceBuffer& b, size_t bytes) {
    b = kernels::DeviceBuffer(rt, std::max<size_t>(bytes, 64));
    stream_->memset_async(b.data(), 0, b.bytes());
  };
  const auto bytes_of = [&](Role r) { return total[static_cast<size_t>(r)]; };
  alloc(master_, bytes_of(Role::master));
  if (!units_.master_is_weights()) alloc(working_, bytes_of(Role::params));
  alloc(grads_, bytes_of(Role::grads));
  alloc(adam_, bytes_of(Role::adam));
  alloc(inputs_, model.input_bytes() * static_cast<size_t>(std::max<int64_t>(model.dims().L, 1)));
  alloc(workspace_, model.workspace_bytes());
  model.bind_workspace(*stream_, workspace_.data());
  stream_->synchronize();
}

void* FlatMemory::acquire(Role r, int index, offload::Mode, Side) {
  if (r == Role::activations) return inputs_.as<char>() + model_.input_bytes() * static_cast<size_t>(index);
  const size_t at = at_[static_cast<size_t>(r)].at(static_cast<size_t>(index));
  switch (r) {
    case Role::params: return static_cast<char*>(weights()) + at;
    case Role::master: return master_.as<char>() + at;
    case Role::adam: return adam_.as<char>() + at;
    case Role::grads: return grads_.as<char>() + at;
    case Role::activations: break;
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
