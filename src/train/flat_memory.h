// FlatMemory: every block of a run in whole-model flat buffers on one runtime, in the order of
// the units' flat numbering — what the model tests use to read any parameter or gradient by
// its offset. It is only a RunMemory: the step itself is the same StepDriver code the tiered
// trainer runs.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/runtime.h"
#include "src/model/transformer.h"
#include "src/train/run_memory.h"
#include "src/zero/unit_table.h"

namespace strata {

class FlatMemory final : public RunMemory {
 public:
  // Allocates master, working weights (fp32 runs: the master itself), grads, AdamW state, the
  // block inputs and the model's workspace (bound to the model), all zeroed. Each state's
  // blocks lie back to back in unit order, sized by the unit table (one rank, all on device).
  FlatMemory(Transformer& model, kernels::Runtime& rt);
  // (the stream's queued kernels finish before the buffers they write into go)
  ~FlatMemory() override { kernels::settle(*stream_); }
  void* acquire(Role r, int index, offload::Mode m, Side side) override;
  void release(Role, int) override {}
  bool master_is_weights() const override { return units_.master_is_weights(); }
  const UnitTable& units() const override { return units_; }
  kernels::Stream& stream(Side) override { return *stream_; }
  kernels::Ops& ops(Side) override { return rt_.ops(); }
  kernels::Runtime* runtime(Side) override { return &rt_; }

  float* master() const { return master_.as<float>(); }  // (n_flat)
  void* weights() const { return working_.data() ? working_.data() : master_.data(); }
  float* grads() const { return grads_.as<float>(); }     // (n_flat)
  // Working weights <- master (a cast; no-op in fp32), enqueued on the stream.
  void sync_weights();
  void zero_grads();
  kernels::Stream& s() { return *stream_; }

 private:
  Transformer& model_;
  kernels::Runtime& rt_;
  std::unique_ptr<kernels::Stream> stream_;
  UnitTable units_;
  std::array<std::vector<size_t>, kNumRoles> at_;  // [role][unit]: the block's first byte in its buffer
  kernels::DeviceBuffer master_, working_, grads_, adam_, inputs_, workspace_;
};

}  // namespace strata
