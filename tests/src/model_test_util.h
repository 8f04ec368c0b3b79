// A Transformer with its blocks in FlatMemory and a StepDriver: the model tests' handle on the
// per-unit phases, with every parameter and gradient readable by its flat offset.
#pragma once
#include <memory>
#include <vector>

#include "src/model/transformer.h"
#include "src/train/flat_memory.h"
#include "src/train/step_driver.h"

namespace strata {

class TestModel {
 public:
  TestModel(const ModelConfig& cfg, DType dt, int64_t B, int64_t T, kernels::Runtime& rt,
            int64_t logits_chunk_bytes = kLogitsChunkBytes, Checkpointing ckpt = {}, const LoraSpec& lora = {})
      : model_(cfg, dt, B, T, rt, ckpt, logits_chunk_bytes, 1, lora), mem_(model_, rt), norm2_(model_.units().size()) {}

  Transformer& model() { return model_; }
  const std::vector<ParamInfo>& params() const { return model_.params(); }
  const ModelDims& dims() const { return model_.dims(); }
  int64_t n_flat() const { return model_.n_flat(); }
  int64_t n_params() const { return model_.n_params(); }
  const ParamInfo* find_param(const std::string& n) const { return model_.find_param(n); }
  const std::vector<Unit>& units() const { return model_.units(); }
  float* master() const { return mem_.master(); }
  float* grads() const { return mem_.grads(); }
  float* loss_rows() const { return model_.loss_rows(); }
  void sync_weights() { mem_.sync_weights(); }
  void zero_grads() { mem_.zero_grads(); }
  // One micro-batch (host ids/targets: the CPU runtime's memory is host memory).
  void forward_backward(const int32_t* ids, const int32_t* tg, float grad_scale, bool accumulate) {
    mem_.s().memset_async(norm2_.data(), 0, norm2_.size() * sizeof(double));  // in stream order
    StepDriver(model_, mem_).forward_backward(ids, tg, grad_scale, !accumulate, true, norm2_.data());
  }
  void forward(const int32_t* ids, const int32_t* tg) { StepDriver(model_, mem_).forward(ids, tg); }
  void synchronize() { mem_.s().synchronize(); }
  const std::vector<double>& unit_norm2() const { return norm2_; }

 private:
  Transformer model_;
  FlatMemory mem_;
  std::vector<double> norm2_;
};

}  // namespace strata
