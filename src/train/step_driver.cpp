// The step's phase sequence. Acquire order is the schedule the offload planner plans from, so
// keep it the same from step to step (a dry run records it before step 1).
#include "src/train/step_driver.h"

#include <algorithm>

namespace strata {
using offload::Mode;

void StepDriver::embed_and_blocks_forward(const int32_t* ids, const PendingUpdate* update) {
  Transformer& m = model_;
  const int64_t L = m.dims().L;
  if (update) optimizer_unit(m.embed_unit(), update->st, update->apply);
  {
    const void* w = use_weights(m.embed_unit());
    void* x0 = L > 0 ? mem_.acquire(Role::input, 0, Mode::write, Side::compute) : nullptr;
    compute([&] { m.embed_forward(mem_.stream(Side::compute), ids, w, L > 0 ? x0 : m.final_residual()); });
    if (L > 0) mem_.release(Role::input, 0);
    drop_weights(m.embed_unit());
  }
  for (int64_t l = 0; l < L; ++l) {
    const int li = static_cast<int>(l);
    if (update) optimizer_unit(m.block_unit(l), update->st, update->apply);
    const void* w = use_weights(m.block_unit(l));
    const void* x = mem_.acquire(Role::input, li, Mode::read, Side::compute);
    const bool last = l + 1 == L;
    void* y = last ? m.final_residual() : mem_.acquire(Role::input, li + 1, Mode::write, Side::compute);
    compute([&] { m.block_forward(mem_.stream(Side::compute), l, w, x, y); });
    if (!last) mem_.release(Role::input, li + 1);
    mem_.release(Role::input, li);
    drop_weights(m.block_unit(l));
  }
}

void StepDriver::forward(const int32_t* ids, const int32_t* targets) {
  Transformer& m = model_;
  embed_and_blocks_forward(ids, nullptr);
  const int fn = m.final_norm_unit();
  const void* w_fn = use_weights(fn);
  const void* w_head = use_head_weights();
  compute([&] { m.head(mem_.stream(Side::compute), targets, w_fn, w_head, nullptr, nullptr, 1.f, false); });
  drop_head_weights();
  drop_weights(fn);
}

void StepDriver::forward_backward(const int32_t* ids, const int32_t* targets, float grad_scale, bool first, bool last,
                                  double* norm2, const PendingUpdate* update) {
  Transformer& m = model_;
  const Mode gmode = first ? Mode::write : Mode::read_write;  // the first micro-batch overwrites
  embed_and_blocks_forward(ids, update);

  // Head: final norm, LM head, cross-entropy and their backward. A tied head is the embedding
  // unit, acquired (weights and grads) across the whole head phase.
  const int fn = m.final_norm_unit(), hu = m.head_unit();
  if (update) {
    optimizer_unit(fn, update->st, update->apply);
    if (!m.tied_head()) optimizer_unit(hu, update->st, update->apply);
  }
  // Stage 2: the backward writes each unit's whole grads into a scratch (every micro-batch as
  // if it were the first), and the grads blocks keep only this rank's shard.
  const bool rs = sh_.sharded_grads();
  const bool cfirst = rs || first;
  {
    const void* w_fn = use_weights(fn);
    const void* w_head = use_head_weights();
    float* g_fn = static_cast<float*>(mem_.acquire(Role::grads, fn, gmode, Side::compute));
    float* g_head = static_cast<float*>(mem_.acquire(Role::grads, hu, gmode, Side::compute));
    compute([&] {
      kernels::Stream& s = mem_.stream(Side::compute);
      float* c_fn = rs ? mem_.grad_scratch(2) : g_fn;
      float* c_head = rs ? mem_.grad_scratch(m.tied_head() ? 0 : 1) : g_head;
      m.head(s, targets, w_fn, w_head, c_fn, c_head, grad_scale, cfirst);
      if (rs) {
        shard_grads(s, fn, c_fn, g_fn, first, last, norm2 + fn);
        if (!m.tied_head()) shard_grads(s, hu, c_head, g_head, first, last, norm2 + hu);
      } else if (last) {
        finish_grads(s, fn, g_fn, norm2 + fn);
        if (!m.tied_head()) finish_grads(s, hu, g_head, norm2 + hu);  // tied: after the embedding's
      }
    });
    mem_.release(Role::grads, hu);
    mem_.release(Role::grads, fn);
    drop_head_weights();
    drop_weights(fn);
  }

  for (int64_t l = m.dims().L - 1; l >= 0; --l) {
    const int u = m.block_unit(l), li = static_cast<int>(l);
    const void* w = use_weights(u);  // gathered again (stage 3): the recompute and backward use it
    const void* x = mem_.acquire(Role::input, li, Mode::read, Side::compute);
    float* g = static_cast<float*>(mem_.acquire(Role::grads, u, gmode, Side::compute));
    compute([&] {
      kernels::Stream& s = mem_.stream(Side::compute);
      if (rs) {
        float* c = mem_.grad_scratch(2);
        m.block_backward(s, l, w, x, c, true);
        shard_grads(s, u, c, g, first, last, norm2 + u);
        return;
      }
      m.block_backward(s, l, w, x, g, first);
      if (last) finish_grads(s, u, g, norm2 + u);
    });
    mem_.release(Role::grads, u);
    mem_.release(Role::input, li);
    drop_weights(u);
  }

  {
    const int eu = m.embed_unit();
    // A tied head wrote this unit's grads in the head phase: they are added to, never overwritten.
    const Mode mode = m.tied_head() ? Mode::read_write : gmode;
    float* g = static_cast<float*>(mem_.acquire(Role::grads, eu, mode, Side::compute));
    compute([&] {
      kernels::Stream& s = mem_.stream(Side::compute);
      if (rs) {
        float* c = mem_.grad_scratch(0);
        m.embed_backward(s, ids, c, true);
        shard_grads(s, eu, c, g, first, last, norm2 + eu);
        return;
      }
      m.embed_backward(s, ids, g, first);
      if (last) finish_grads(s, eu, g, norm2 + eu);
    });
    mem_.release(Role::grads, eu);
  }
}

int StepDriver::slot_of(int u) const {
  if (u == model_.embed_unit()) return 0;
  return u == model_.head_unit() && !model_.tied_head() ? 1 : 2;
}

const void* StepDriver::use_weights(int u) {
  const void* w = mem_.acquire(Role::weights, u, Mode::read, Side::compute);
  if (!sh_.sharded_weights()) return w;
  // Stage 3: every rank's shard, in rank order, into the slot's whole-unit buffer (stream
  // order: the previous user of the slot has finished with it). The shard block is free again
  // once the gather has read it, so it is released at once.
  void* whole = mem_.gathered(slot_of(u));
  compute([&] {
    const Unit& unit = model_.units()[static_cast<size_t>(u)];
    comm_->all_gather(w, whole, static_cast<size_t>(sh_.shard(unit.numel)), model_.dtype(), mem_.stream(Side::compute));
  });
  mem_.release(Role::weights, u);
  return whole;
}

void StepDriver::drop_weights(int u) {
  if (!sh_.sharded_weights()) mem_.release(Role::weights, u);
}

// Stage 3 with a tied head: the embedding is still whole in slot 0 from this pass's embedding
// forward (nothing else uses slot 0, and its update ran before that forward), so the head
// phase uses it as it is, without gathering it again.
const void* StepDriver::use_head_weights() {
  if (sh_.sharded_weights() && model_.tied_head()) return mem_.gathered(0);
  return use_weights(model_.head_unit());
}

void StepDriver::drop_head_weights() {
  if (!(sh_.sharded_weights() && model_.tied_head())) drop_weights(model_.head_unit());
}

void StepDriver::finish_grads(kernels::Stream& s, int u, float* g, double* norm2) {
  const Unit& unit = model_.units()[static_cast<size_t>(u)];
  if (sh_.world == 1) {
    model_.grad_sum_squares(s, u, g, norm2);
    return;
  }
  // Stages 0 and 1: every rank gets the whole sum (fixed rank order, so bitwise what a
  // reduce-scatter gives each shard). The norm takes only this rank's shard, so that every
  // stage sums the same shard sums in the same order.
  comm_->all_reduce(g, g, static_cast<size_t>(unit.numel), DType::f32, s);
  const int64_t S = sh_.shard(unit.numel), lo = sh_.rank * S, hi = std::min(lo + S, unit.n_real);
  if (hi > lo) mem_.ops(Side::compute).sum_squares(s, {.dtype = DType::f32, .n = hi - lo, .x = g + lo, .out = norm2});
}

void StepDriver::shard_grads(kernels::Stream& s, int u, float* whole, float* shard, bool first, bool last,
                             double* norm2) {
  const Unit& unit = model_.units()[static_cast<size_t>(u)];
  const int64_t S = sh_.shard(unit.numel), lo = sh_.rank * S;
  float* mine = whole + lo;
  comm_->reduce_scatter(whole, mine, static_cast<size_t>(S), DType::f32, s);  // in place
  if (first)
    s.memcpy_async(shard, mine, static_cast<size_t>(S) * 4);
  else
    mem_.ops(Side::compute).add(s, {.dtype = DType::f32, .n = S, .a = shard, .b = mine, .out = shard});
  const int64_t n = std::min(S, unit.n_real - lo);
  if (last && n > 0) mem_.ops(Side::compute).sum_squares(s, {.dtype = DType::f32, .n = n, .x = shard, .out = norm2});
}

void StepDriver::optimizer(const AdamWStep& st, bool apply) {
  for (size_t ui = 0; ui < model_.units().size(); ++ui) optimizer_unit(static_cast<int>(ui), st, apply);
}

void StepDriver::optimizer_unit(int u, const AdamWStep& st, bool apply) {
  Transformer& m = model_;
  const bool aliased = mem_.master_is_weights();
  const DType dt = m.dtype();
  const size_t esz = kernels::dtype_size(dt);
  const Unit& unit = m.units()[static_cast<size_t>(u)];
  // This rank's part of the unit: [lo, lo + n). Unsharded: the whole unit. Sharded (stage >= 1):
  // master and AdamW state hold only the shard (m then v, each n long), the grads all of the
  // unit (stage 1) or the shard (stages 2, 3); the new working weights of every shard are then
  // all-gathered into the whole weights block (stages 1, 2), or the weights block is the shard
  // (stage 3: gathered when a phase uses the unit).
  const bool sharded = sh_.sharded_optimizer();
  const int64_t n = sharded ? sh_.shard(unit.numel) : unit.numel;
  const int64_t lo = sharded ? sh_.rank * n : 0;
  float* master = static_cast<float*>(mem_.acquire(Role::master, u, Mode::read_write, Side::optimizer));
  float* adam = static_cast<float*>(mem_.acquire(Role::adam, u, Mode::read_write, Side::optimizer));
  const float* g = static_cast<const float*>(mem_.acquire(Role::grads, u, Mode::read, Side::optimizer));
  // The new working weights: written whole (parameters by AdamW, padding zeroed here, the
  // other ranks' shards by the all-gather; stage 3: the block is this rank's shard).
  void* w = aliased ? nullptr : mem_.acquire(Role::weights, u, Mode::write, Side::optimizer);
  compute([&] {
    kernels::Stream& s = mem_.stream(Side::optimizer);
    kernels::Ops& ops = mem_.ops(Side::optimizer);
    float* mm = adam;
    float* vv = adam + n;
    const float* gs = sh_.sharded_grads() ? g : g + lo;
    const bool gather = sharded && !sh_.sharded_weights();
    // ws: element lo of the unit's working weights
    char* ws = w ? static_cast<char*>(w) + (gather ? static_cast<size_t>(lo) * esz : 0) : nullptr;
    if (!apply) {
      if (w) ops.cast(s, {.n = n, .src = master, .src_dtype = DType::f32, .dst = ws, .dst_dtype = dt});
    } else {
      // The unit's decay ranges, cut at the shard's bounds.
      for (const UnitRange& r : unit.adamw_ranges) {
        const int64_t a = std::max(r.offset, lo), b = std::min(r.offset + r.numel, lo + n);
        if (b <= a) continue;
        const int64_t k = a - lo;
        adamw_range(ops, s, st, r.decay, b - a, master + k, mm + k, vv + k, gs + k,
                    ws ? ws + static_cast<size_t>(k) * esz : nullptr, dt);
      }
      const int64_t pad = std::max(unit.n_real, lo);
      if (ws && lo + n > pad)
        s.memset_async(ws + static_cast<size_t>(pad - lo) * esz, 0, static_cast<size_t>(lo + n - pad) * esz);
    }
    if (gather) comm_->all_gather(ws, w, static_cast<size_t>(n), dt, s);
  });
  if (!aliased) mem_.release(Role::weights, u);
  mem_.release(Role::grads, u);
  mem_.release(Role::adam, u);
  mem_.release(Role::master, u);
}

}  // namespace strata
