// The step's phase sequence. Acquire order is the schedule the offload planner plans from, so
// keep it the same from step to step (a dry run records it before step 1).
#include "src/train/step_driver.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <stdexcept>

#include "src/zero/unit_table.h"

namespace strata {
using offload::Mode;

StepDriver::StepDriver(Transformer& model, RunMemory& mem, Sharding sh, Communicator* comm)
    : model_(model), mem_(mem), sh_(sh), comm_(comm) {
  const Sharding& t = mem_.units().sharding();
  if (t.stage != sh.stage || t.world != sh.world || t.rank != sh.rank)
    throw std::logic_error("StepDriver: sharding (stage " + std::to_string(sh.stage) + ", rank " +
                           std::to_string(sh.rank) + " of " + std::to_string(sh.world) +
                           ") is not the memory's (stage " + std::to_string(t.stage) + ", rank " +
                           std::to_string(t.rank) + " of " + std::to_string(t.world) + ")");
  if (mem_.dry() || !overlap()) return;
  kernels::Runtime* rt = mem_.runtime(Side::compute);
  if (!rt) return;
  for (auto* set : {&gathered_ev_, &slot_free_ev_, &scratch_written_ev_, &scratch_read_ev_})
    for (auto& e : *set) e = rt->create_event();
  for (auto& e : ready_ev_) e = rt->create_event();
  for (Side side : {Side::compute, Side::optimizer, Side::comm})
    if (kernels::Runtime* r = mem_.runtime(side)) order_ev_[static_cast<size_t>(side)] = r->create_event();
  timed_waits_ = rt->info().backend == kernels::Backend::cpu;
}

void StepDriver::order(Side from, Side to) {
  compute([&] {
    kernels::Stream& a = mem_.stream(from);
    kernels::Stream& b = mem_.stream(to);
    if (&a == &b) return;
    kernels::Event& e = *order_ev_[static_cast<size_t>(from)];
    a.record(e);
    b.wait(e);
  });
}

// On the CPU backend a stream's wait blocks its worker, so doing it in a host function instead
// is the same wait, timed. A CUDA stream waits on the device (not timed here).
void StepDriver::await_on_compute(kernels::Event& ev) {
  kernels::Stream& c = mem_.stream(Side::compute);
  if (!timed_waits_) {
    c.wait(ev);
    return;
  }
  std::shared_ptr<kernels::EventPoint> p = ev.point();
  if (!p) return;  // never recorded: nothing to wait for
  c.host_fn([p, acc = exposed_ns_] {
    const auto t0 = std::chrono::steady_clock::now();
    std::exception_ptr err = p->wait_host();
    acc->fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    if (err) std::rethrow_exception(err);  // the collective failed: so does compute
  });
}

void StepDriver::begin_pass(const PendingUpdate* update, bool backward) {
  uses_.clear();  // (a pass that failed half way may have left some)
  held_.clear();
  held_head_ = false;
  cursor_ = 0;
  update_ = update;
  const bool s3 = sh_.sharded_weights();
  if (!update && !s3) return;
  const Transformer& m = model_;
  int turn = 0;
  auto add = [&](int u, bool may_update) {
    Use x;
    x.unit = u;
    x.update = may_update && update;
    x.gather = s3;
    if (s3) x.slot = slot_of(u) == 2 ? 2 + (turn++ % 2) : slot_of(u);
    if (x.update || x.gather) uses_.push_back(x);
  };
  add(m.embed_unit(), true);
  for (int64_t l = 0; l < m.dims().L; ++l) add(m.block_unit(l), true);
  add(m.final_norm_unit(), true);
  if (!m.tied_head()) add(m.head_unit(), true);  // a tied head is the embedding: updated and gathered already
  if (backward && s3)
    for (int64_t l = m.dims().L - 1; l >= 0; --l) add(m.block_unit(l), false);
}

void StepDriver::end_pass() {
  if (cursor_ != uses_.size() || !held_.empty())
    throw std::logic_error("StepDriver: a pass ended with weights not used (" + std::to_string(uses_.size() - cursor_) +
                           ") or still held (" + std::to_string(held_.size()) + ")");
  if (!overlap()) return;
  compute([&] {
    kernels::Stream& c = mem_.stream(Side::comm);
    if (&c == &mem_.stream(Side::compute)) return;
    kernels::Event& e = *order_ev_[static_cast<size_t>(Side::comm)];
    c.record(e);
    await_on_compute(e);
  });
}

void StepDriver::prepare(size_t i) {
  if (i >= uses_.size() || uses_[i].prepared) return;
  Use& x = uses_[i];
  x.prepared = true;
  if (x.update) x.ready = update_unit(x.unit, update_->st, update_->apply);
  if (!x.gather) return;
  // Stage 3: every rank's shard, in rank order, into the slot's whole-unit buffer once compute
  // is done with the slot's previous unit. The shard block is released once the gather has
  // read it (in the comm stream's order).
  void* whole = mem_.gathered(x.slot);
  compute([&] { mem_.stream(Side::comm).wait(*slot_free_ev_[static_cast<size_t>(x.slot)]); });
  const void* w = mem_.acquire(Role::weights, x.unit, Mode::read, Side::comm);
  compute([&] {
    kernels::Stream& c = mem_.stream(Side::comm);
    comm_->all_gather(w, whole, static_cast<size_t>(mem_.units()[x.unit].weights.n), model_.dtype(), c);
    c.record(*gathered_ev_[static_cast<size_t>(x.slot)]);
  });
  mem_.release(Role::weights, x.unit);
  x.ready = mem_.dry() ? nullptr : gathered_ev_[static_cast<size_t>(x.slot)].get();
}

void StepDriver::embed_and_blocks_forward(const int32_t* ids) {
  Transformer& m = model_;
  const int64_t L = m.dims().L;
  {
    const void* w = use_weights(m.embed_unit());
    void* x0 = L > 0 ? mem_.acquire(Role::input, 0, Mode::write, Side::compute) : nullptr;
    compute([&] { m.embed_forward(mem_.stream(Side::compute), ids, w, L > 0 ? x0 : m.final_residual()); });
    if (L > 0) mem_.release(Role::input, 0);
    drop_weights(m.embed_unit(), last_pass_ && !m.tied_head());  // its backward needs no weights
  }
  for (int64_t l = 0; l < L; ++l) {
    const int li = static_cast<int>(l);
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
  begin_pass(nullptr, false);
  last_pass_ = false;
  embed_and_blocks_forward(ids);
  const int fn = m.final_norm_unit();
  const void* w_fn = use_weights(fn);
  const void* w_head = use_head_weights();
  compute([&] { m.head(mem_.stream(Side::compute), targets, w_fn, w_head, nullptr, nullptr, 1.f, false); });
  drop_head_weights();
  drop_weights(fn);
  end_pass();
}

void StepDriver::micro_batch(const MicroBatch& mb, const int32_t* ids, const int32_t* targets, float grad_scale,
                             double* norm2, const PendingUpdate* pending, const AdamWStep* now) {
  if ((mb.pending_update && !pending) || (mb.update_in_backward && !now))
    throw std::logic_error("StepDriver: micro-batch " + std::to_string(mb.index) + " runs an update that was not given");
  forward_backward(ids, targets, grad_scale, mb.first, mb.last, norm2, mb.pending_update ? pending : nullptr,
                   mb.update_in_backward ? now : nullptr);
}

void StepDriver::forward_backward(const int32_t* ids, const int32_t* targets, float grad_scale, bool first, bool last,
                                  double* norm2, const PendingUpdate* update, const AdamWStep* update_now) {
  Transformer& m = model_;
  if (update_now && (!last || sh_.sharded_grads() || update))
    throw std::logic_error(
        "StepDriver: an update in the backward needs the last micro-batch, whole grads (stage 0-1) and no pending update");
  // Unit u's gradient is final: its optimizer step now (update_now), after its compute.
  const auto update_final = [&](int u) {
    if (update_now) update_unit(u, *update_now, true);
  };
  const Mode gmode = first ? Mode::write : Mode::read_write;  // the first micro-batch overwrites
  begin_pass(update, true);
  last_pass_ = last;
  embed_and_blocks_forward(ids);

  // Head: final norm, LM head, cross-entropy and their backward. A tied head is the embedding
  // unit, acquired (weights and grads) across the whole head phase.
  const int fn = m.final_norm_unit(), hu = m.head_unit();
  // Stages 2-3: the backward writes each unit's whole grads into a scratch slot (every
  // micro-batch as if it were the first), reduce-scattered on the comm stream into the grads
  // block, which keeps only this rank's shard.
  const bool rs = sh_.sharded_grads();
  const bool reduce = last && sh_.world > 1;  // stages 0-1: all-reduce the final grads
  if (rs) {
    const void* w_fn = use_weights(fn);
    const void* w_head = use_head_weights();
    const int s_fn = next_scratch_slot(fn), s_head = m.tied_head() ? 0 : 1;
    float* c_fn = scratch_for(s_fn);
    float* c_head = scratch_for(s_head);
    compute([&] { m.head(mem_.stream(Side::compute), targets, w_fn, w_head, c_fn, c_head, grad_scale, true); });
    drop_head_weights(last);
    drop_weights(fn, last);
    reduce_scatter_async(fn, s_fn, gmode, first, last, norm2 + fn);
    if (!m.tied_head()) reduce_scatter_async(hu, s_head, gmode, first, last, norm2 + hu);  // tied: with the embedding's
  } else {
    const void* w_fn = use_weights(fn);
    const void* w_head = use_head_weights();
    float* g_fn = static_cast<float*>(mem_.acquire(Role::grads, fn, gmode, Side::compute));
    float* g_head = static_cast<float*>(mem_.acquire(Role::grads, hu, gmode, Side::compute));
    compute([&] {
      kernels::Stream& s = mem_.stream(Side::compute);
      m.head(s, targets, w_fn, w_head, g_fn, g_head, grad_scale, first);
      if (last && sh_.world == 1) {
        m.grad_sum_squares(s, fn, g_fn, norm2 + fn);
        if (!m.tied_head()) m.grad_sum_squares(s, hu, g_head, norm2 + hu);  // tied: after the embedding's
      }
    });
    if (reduce) {
      reduce_grads_async(fn, g_fn, norm2 + fn);
      if (!m.tied_head()) reduce_grads_async(hu, g_head, norm2 + hu);
    }
    mem_.release(Role::grads, hu);
    mem_.release(Role::grads, fn);
    drop_head_weights(last);
    drop_weights(fn, last);
    update_final(fn);
    if (!m.tied_head()) update_final(hu);  // tied: with the embedding's, after its backward
  }

  for (int64_t l = m.dims().L - 1; l >= 0; --l) {
    const int u = m.block_unit(l), li = static_cast<int>(l);
    const void* w = use_weights(u);  // gathered again (stage 3): the recompute and backward use it
    const void* x = mem_.acquire(Role::input, li, Mode::read, Side::compute);
    if (rs) {
      const int slot = next_scratch_slot(u);
      float* c = scratch_for(slot);
      compute([&] { m.block_backward(mem_.stream(Side::compute), l, w, x, c, true); });
      mem_.release(Role::input, li);
      drop_weights(u, last);
      reduce_scatter_async(u, slot, gmode, first, last, norm2 + u);
      continue;
    }
    float* g = static_cast<float*>(mem_.acquire(Role::grads, u, gmode, Side::compute));
    compute([&] {
      kernels::Stream& s = mem_.stream(Side::compute);
      m.block_backward(s, l, w, x, g, first);
      if (last && sh_.world == 1) m.grad_sum_squares(s, u, g, norm2 + u);
    });
    if (reduce) reduce_grads_async(u, g, norm2 + u);
    mem_.release(Role::grads, u);
    mem_.release(Role::input, li);
    drop_weights(u, last);
    update_final(u);
  }

  const int eu = m.embed_unit();
  if (rs) {
    // A tied head wrote slot 0 in the head phase: the embedding's backward adds to it.
    float* c = m.tied_head() ? mem_.grad_scratch(0) : scratch_for(0);
    compute([&] { m.embed_backward(mem_.stream(Side::compute), ids, c, true); });
    reduce_scatter_async(eu, 0, gmode, first, last, norm2 + eu);
  } else {
    // A tied head wrote this unit's grads in the head phase: they are added to, never overwritten.
    const Mode mode = m.tied_head() ? Mode::read_write : gmode;
    float* g = static_cast<float*>(mem_.acquire(Role::grads, eu, mode, Side::compute));
    compute([&] {
      kernels::Stream& s = mem_.stream(Side::compute);
      m.embed_backward(s, ids, g, first);
      if (last && sh_.world == 1) m.grad_sum_squares(s, eu, g, norm2 + eu);
    });
    if (reduce) reduce_grads_async(eu, g, norm2 + eu);
    mem_.release(Role::grads, eu);
    update_final(eu);
  }
  end_pass();
}

int StepDriver::slot_of(int u) const {
  if (u == model_.embed_unit()) return 0;
  return u == model_.head_unit() && !model_.tied_head() ? 1 : 2;
}

int StepDriver::next_scratch_slot(int u) {
  const int slot = slot_of(u);
  if (slot != 2) return slot;
  rest_slot_ = rest_slot_ == 2 ? 3 : 2;
  return rest_slot_;
}

float* StepDriver::scratch_for(int slot) {
  compute([&] { await_on_compute(*scratch_read_ev_[static_cast<size_t>(slot)]); });
  return mem_.grad_scratch(slot);
}

const void* StepDriver::use_weights(int u) {
  if (cursor_ < uses_.size() && uses_[cursor_].unit == u) {
    const size_t i = cursor_++;
    prepare(i);
    const Use& x = uses_[i];
    if (x.ready) compute([&] { await_on_compute(*x.ready); });
    if (overlap()) prepare(i + 1);  // the next unit's weights come while this one computes
    if (x.gather) {
      held_.emplace_back(u, x.slot);
      return mem_.gathered(x.slot);
    }
  }
  return mem_.acquire(Role::weights, u, Mode::read, Side::compute);
}

void StepDriver::drop_weights(int u, bool last) {
  for (auto it = held_.begin(); it != held_.end(); ++it) {
    if (it->first != u) continue;
    // Stage 3 with a tied head: the embedding stays gathered until the head phase is done.
    if (u == model_.embed_unit() && model_.tied_head() && !held_head_) {
      held_head_ = true;
      return;
    }
    const int slot = it->second;
    held_.erase(it);
    if (u == model_.embed_unit()) held_head_ = false;
    compute([&] { mem_.stream(Side::compute).record(*slot_free_ev_[static_cast<size_t>(slot)]); });
    return;
  }
  if (sh_.sharded_weights()) return;
  if (last && !mem_.master_is_weights())
    mem_.release_discard(Role::weights, u);
  else
    mem_.release(Role::weights, u);
}

// Stage 3 with a tied head: the embedding is still whole in slot 0 from this pass's embedding
// forward (nothing else uses slot 0, and its update ran before that forward), so the head
// phase uses it as it is, without gathering it again.
const void* StepDriver::use_head_weights() {
  if (sh_.sharded_weights() && model_.tied_head()) return mem_.gathered(0);
  return use_weights(model_.head_unit());
}

void StepDriver::drop_head_weights(bool last) { drop_weights(model_.head_unit(), last); }

void StepDriver::reduce_grads_async(int u, float* g, double* norm2) {
  // Stages 0 and 1: every rank gets the whole sum (fixed rank order, so bitwise what a
  // reduce-scatter gives each shard). The norm takes only this rank's shard, so that every
  // stage sums the same shard sums in the same order.
  order(Side::compute, Side::comm);
  mem_.handoff(Role::grads, u, Side::comm);
  compute([&] {
    kernels::Stream& c = mem_.stream(Side::comm);
    const UnitEntry& e = mem_.units()[u];
    comm_->all_reduce(g, g, static_cast<size_t>(e.grads.n), DType::f32, c);
    const int64_t lo = e.shards.dp.offset, hi = std::min(lo + e.shards.dp.shard, e.n_real);
    if (hi > lo) mem_.ops(Side::comm).sum_squares(c, {.dtype = DType::f32, .n = hi - lo, .x = g + lo, .out = norm2});
  });
}

void StepDriver::reduce_scatter_async(int u, int slot, Mode gmode, bool first, bool last, double* norm2) {
  order(Side::compute, Side::comm);  // the backward has written the slot
  float* g = static_cast<float*>(mem_.acquire(Role::grads, u, gmode, Side::comm));
  compute([&] {
    kernels::Stream& c = mem_.stream(Side::comm);
    shard_grads(c, u, mem_.grad_scratch(slot), g, first, last, norm2);
    c.record(*scratch_read_ev_[static_cast<size_t>(slot)]);
  });
  mem_.release(Role::grads, u);
}

// Stages 2-3: the unit's whole grads of this micro-batch (in `whole`, a scratch) are summed
// across ranks into this rank's shard (reduce-scatter, in place), which is stored in (first) or
// added to the shard grads block; on the last micro-batch the shard's Σ g² goes to *norm2.
void StepDriver::shard_grads(kernels::Stream& s, int u, float* whole, float* shard, bool first, bool last,
                             double* norm2) {
  const UnitEntry& e = mem_.units()[u];
  const int64_t S = e.shards.dp.shard, lo = e.shards.dp.offset;
  float* mine = whole + lo;
  kernels::Ops& ops = mem_.ops(Side::comm);
  comm_->reduce_scatter(whole, mine, static_cast<size_t>(S), DType::f32, s);  // in place
  if (first)
    s.memcpy_async(shard, mine, static_cast<size_t>(S) * 4);
  else
    ops.add(s, {.dtype = DType::f32, .n = S, .a = shard, .b = mine, .out = shard});
  const int64_t n = std::min(S, e.n_real - lo);
  if (last && n > 0) ops.sum_squares(s, {.dtype = DType::f32, .n = n, .x = shard, .out = norm2});
}

void StepDriver::optimizer(const AdamWStep& st, bool apply) {
  for (size_t ui = 0; ui < model_.units().size(); ++ui) update_unit(static_cast<int>(ui), st, apply);
  end_pass();
}

kernels::Event* StepDriver::update_unit(int u, const AdamWStep& st, bool apply) {
  Transformer& m = model_;
  const bool aliased = mem_.master_is_weights();
  const DType dt = m.dtype();
  const size_t esz = kernels::dtype_size(dt);
  const Unit& unit = m.units()[static_cast<size_t>(u)];
  const UnitEntry& e = mem_.units()[u];
  // This rank's part of the unit: the master's elements [lo, lo + n), with the AdamW state
  // over the same elements; the grads and weights blocks hold e.grads and e.weights of the
  // unit. Where the update writes only part of a whole weights block, every rank's new part is
  // then all-gathered into it on the comm stream (stages 1, 2); stage 3's weights block is the
  // shard itself (gathered when a phase uses the unit).
  const int64_t n = e.master.n, lo = e.master.lo;
  const bool gather = e.gathers_after_update();
  float* master = static_cast<float*>(mem_.acquire(Role::master, u, Mode::read_write, Side::optimizer));
  float* adam = static_cast<float*>(mem_.acquire(Role::adam, u, Mode::read_write, Side::optimizer));
  const float* g = static_cast<const float*>(mem_.acquire(Role::grads, u, Mode::read, Side::optimizer));
  // The new working weights: written whole (parameters by AdamW, padding zeroed here, the
  // other ranks' shards by the all-gather; stage 3: the block is this rank's shard).
  void* w = aliased ? nullptr : mem_.acquire(Role::weights, u, Mode::write, Side::optimizer);
  // ws: element lo of the unit's working weights
  char* ws = w ? static_cast<char*>(w) + static_cast<size_t>(lo - e.weights.lo) * esz : nullptr;
  compute([&] {
    kernels::Stream& s = mem_.stream(Side::optimizer);
    kernels::Ops& ops = mem_.ops(Side::optimizer);
    const AdamLayout al = e.adam_layout();
    float* mm = adam + al.m_offset();
    float* vv = adam + al.v_offset();
    const float* gs = g + (lo - e.grads.lo);  // element lo of the unit's grads
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
  });
  kernels::Event* ready = nullptr;
  if (gather) {  // the other ranks' new shards, on the comm stream once this shard is written
    order(Side::optimizer, Side::comm);
    mem_.handoff(Role::weights, u, Side::comm);
    compute([&] {
      kernels::Stream& c = mem_.stream(Side::comm);
      comm_->all_gather(ws, w, static_cast<size_t>(n), dt, c);
      if (ready_ev_[0]) {
        ready = ready_ev_[next_ready_++ % ready_ev_.size()].get();
        c.record(*ready);
      }
    });
  }
  if (!aliased) mem_.release(Role::weights, u);
  // The gradients are spent: the next step's backward overwrites them before anything reads
  // them, so an offloaded copy is dropped instead of written home.
  mem_.release_discard(Role::grads, u);
  mem_.release(Role::adam, u);
  mem_.release(Role::master, u);
  return ready;
}

}  // namespace strata
