// The step's phase sequence. Acquire order is the schedule the offload planner plans from, so
// keep it the same from step to step (a dry run records it before step 1).
#include "src/train/step_driver.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "src/zero/unit_table.h"

namespace strata {
using offload::Mode;

StepDriver::StepDriver(Transformer& model, RunMemory& mem, Sharding sh, Communicator* comm)
    : model_(model), mem_(mem), units_(model, mem, comm) {
  const Sharding& t = mem_.units().sharding();
  if (t.stage != sh.stage || t.world != sh.world || t.rank != sh.rank)
    throw std::logic_error("StepDriver: sharding (stage " + std::to_string(sh.stage) + ", rank " +
                           std::to_string(sh.rank) + " of " + std::to_string(sh.world) +
                           ") is not the memory's (stage " + std::to_string(t.stage) + ", rank " +
                           std::to_string(t.rank) + " of " + std::to_string(t.world) + ")");
}

void StepDriver::embed_and_blocks_forward(const int32_t* ids, bool embed_spent) {
  Transformer& m = model_;
  const int64_t L = m.dims().L;
  {
    const void* w = units_.use_weights(m.embed_unit());
    void* x0 = L > 0 ? mem_.acquire(Role::activations, 0, Mode::write, Side::compute) : nullptr;
    compute([&] { m.embed_forward(mem_.stream(Side::compute), ids, w, L > 0 ? x0 : m.final_residual()); });
    if (L > 0) mem_.release(Role::activations, 0);
    units_.drop_weights(m.embed_unit(), embed_spent);
  }
  for (int64_t l = 0; l < L; ++l) {
    const int li = static_cast<int>(l);
    const void* w = units_.use_weights(m.block_unit(l));
    const int lu = m.lora_unit(l);  // LoRA: the layer's adapters
    const void* wl = lu >= 0 ? units_.use_weights(lu) : nullptr;
    const void* x = mem_.acquire(Role::activations, li, Mode::read, Side::compute);
    const bool last = l + 1 == L;
    void* y = last ? m.final_residual() : mem_.acquire(Role::activations, li + 1, Mode::write, Side::compute);
    compute([&] { m.block_forward(mem_.stream(Side::compute), l, w, x, y, wl); });
    if (!last) mem_.release(Role::activations, li + 1);
    mem_.release(Role::activations, li);
    if (lu >= 0) units_.drop_weights(lu);
    units_.drop_weights(m.block_unit(l));
  }
}

void StepDriver::forward(const int32_t* ids, const int32_t* targets) {
  Transformer& m = model_;
  units_.begin_pass({});
  embed_and_blocks_forward(ids, false);
  const int fn = m.final_norm_unit();
  const void* w_fn = units_.use_weights(fn);
  const void* w_head = units_.use_head_weights();
  compute([&] { m.head(mem_.stream(Side::compute), targets, w_fn, w_head, nullptr, nullptr, 1.f, false); });
  units_.drop_head_weights();
  units_.drop_weights(fn);
  units_.end_pass();
}

void StepDriver::micro_batch(const MicroBatch& mb, const int32_t* ids, const int32_t* targets, float grad_scale,
                             double* norm2, const PendingUpdate* pending, const AdamWStep* now) {
  if ((mb.pending_update && !pending) || (mb.update_in_backward && !now))
    throw std::logic_error("StepDriver: micro-batch " + std::to_string(mb.index) + " runs an update that was not given");
  forward_backward(ids, targets, grad_scale, mb.first, mb.last, norm2, mb.pending_update ? pending : nullptr,
                   mb.update_in_backward ? now : nullptr);
}

// Each unit's backward writes where units_.open_grads says, and its gradient travels on (summed
// across ranks, spent by an update in the backward) once the phase has released its blocks.
void StepDriver::forward_backward(const int32_t* ids, const int32_t* targets, float grad_scale, bool first, bool last,
                                  double* norm2, const PendingUpdate* update, const AdamWStep* update_now) {
  Transformer& m = model_;
  units_.begin_pass({.backward = true, .first = first, .last = last, .norm2 = norm2, .update = update,
                     .update_now = update_now});
  embed_and_blocks_forward(ids, last && !m.tied_head());  // its backward needs no weights

  // Head: final norm, LM head, cross-entropy and their backward. A tied head is the embedding
  // unit, acquired (weights and grads) across the whole head phase.
  const int fn = m.final_norm_unit();
  {
    const void* w_fn = units_.use_weights(fn);
    const void* w_head = units_.use_head_weights();
    const std::pair<float*, float*> g = units_.open_head_grads();
    float* g_fn = g.first;
    float* g_head = g.second;
    const bool overwrite = units_.overwrites();
    const bool frozen = !m.units()[static_cast<size_t>(fn)].trainable;  // LoRA: d x_L only
    compute([&] {
      m.head(mem_.stream(Side::compute), targets, w_fn, w_head, g_fn, g_head, grad_scale, overwrite, frozen);
    });
    units_.close_head_grads();
    units_.drop_head_weights(last);
    units_.drop_weights(fn, last);
    units_.finish_head_grads();
  }

  for (int64_t l = m.dims().L - 1; l >= 0; --l) {
    const int u = m.block_unit(l), li = static_cast<int>(l);
    const void* w = units_.use_weights(u);  // gathered again (stage 3): the recompute and backward use it
    const int lu = m.lora_unit(l);
    const void* wl = lu >= 0 ? units_.use_weights(lu) : nullptr;
    const void* x = mem_.acquire(Role::activations, li, Mode::read, Side::compute);
    float* g = units_.open_grads(u);  // null: frozen (LoRA's base)
    float* gl = lu >= 0 ? units_.open_grads(lu) : nullptr;
    const bool overwrite = units_.overwrites();
    compute([&] { m.block_backward(mem_.stream(Side::compute), l, w, x, g, overwrite, wl, gl); });
    if (lu >= 0) units_.close_grads(lu);
    units_.close_grads(u);
    mem_.release(Role::activations, li);
    if (lu >= 0) units_.drop_weights(lu, last);
    units_.drop_weights(u, last);
    if (lu >= 0) units_.finish_grads(lu);
    units_.finish_grads(u);
  }

  // A tied head wrote this unit's grads in the head phase: its backward adds to them.
  const int eu = m.embed_unit();
  float* g = units_.open_grads(eu);
  const bool overwrite = units_.overwrites();
  if (g) compute([&] { m.embed_backward(mem_.stream(Side::compute), ids, g, overwrite); });  // null: frozen
  units_.close_grads(eu);
  units_.finish_grads(eu);
  units_.end_pass();
}

void StepDriver::optimizer(const AdamWStep& st, bool apply) { units_.optimizer(st, apply); }

}  // namespace strata
