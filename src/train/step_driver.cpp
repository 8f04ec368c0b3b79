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
  kernels::Runtime* rt = mem_.runtime(Side::compute);
  if (model_.pipeline().on() && !mem_.dry() && rt && &mem_.stream(Side::comm) != &mem_.stream(Side::compute)) {
    pipe_ev_ = std::make_unique<PipeEvents>();
    for (auto* e : {&pipe_ev_->compute_done, &pipe_ev_->in_ready, &pipe_ev_->grad_ready, &pipe_ev_->out_free,
                    &pipe_ev_->grad_free, &pipe_ev_->comm_done})
      *e = rt->create_event();
  }
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
  blocks_forward(0, L);
}

// Forward of layers [first, end): each reads its kept input and writes the next layer's, the
// last one the final residual (pipeline parallel: the stage's output, sent on or the head's).
void StepDriver::blocks_forward(int64_t first, int64_t end) {
  Transformer& m = model_;
  for (int64_t l = first; l < end; ++l) {
    const void* w = units_.use_weights(m.block_unit(l));
    const int lu = m.lora_unit(l);  // LoRA: the layer's adapters
    const void* wl = lu >= 0 ? units_.use_weights(lu) : nullptr;
    const int li = m.activation_index(l);
    const void* x = mem_.acquire(Role::activations, li, Mode::read, Side::compute);
    const bool out = l + 1 == end;
    // (pipeline parallel: the previous micro-batch's send may still be reading the output)
    if (out && !m.pipeline().last_stage()) compute_waits(&PipeEvents::out_free);
    void* y = out ? m.final_residual() : mem_.acquire(Role::activations, li + 1, Mode::write, Side::compute);
    compute([&] { m.block_forward(mem_.stream(Side::compute), l, w, x, y, wl); });
    if (!out) mem_.release(Role::activations, li + 1);
    mem_.release(Role::activations, li);
    if (lu >= 0) units_.drop_weights(lu);
    units_.drop_weights(m.block_unit(l));
  }
}

void StepDriver::forward(const int32_t* ids, const int32_t* targets) {
  Transformer& m = model_;
  const PipelineStage& pp = m.pipeline();
  if (pp.on()) {  // through the stages (slot 0's activations); the last one's head computes the losses
    const PipelineInputs in{.micro_batches = 1, .select = [&](int64_t) { return std::pair{ids, targets}; },
                            .losses = {}, .embed_group = nullptr};
    pipe_recv_forward(0);
    stage_forward(0, in);
    pipe_send_forward(-1);
    pipe_drain();
    if (!pp.last_stage()) return;
    units_.begin_pass({});
  } else {
    units_.begin_pass({});
    embed_and_blocks_forward(ids, false);
  }
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

  head_phase(targets, grad_scale, last);
  blocks_backward(0, m.dims().L, last);

  // A tied head wrote this unit's grads in the head phase: its backward adds to them.
  const int eu = m.embed_unit();
  float* g = units_.open_grads(eu);
  const bool overwrite = units_.overwrites();
  if (g) compute([&] { m.embed_backward(mem_.stream(Side::compute), ids, g, overwrite); });  // null: frozen
  units_.close_grads(eu);
  units_.finish_grads(eu);
  units_.end_pass();
}

// Head: final norm, LM head, cross-entropy and their backward. A tied head is the embedding
// unit, acquired (weights and grads) across the whole head phase.
void StepDriver::head_phase(const int32_t* targets, float grad_scale, bool last) {
  Transformer& m = model_;
  const int fn = m.final_norm_unit();
  const void* w_fn = units_.use_weights(fn);
  const void* w_head = units_.use_head_weights();
  const std::pair<float*, float*> g = units_.open_head_grads();
  float* g_fn = g.first;
  float* g_head = g.second;
  const bool overwrite = units_.overwrites();
  const bool frozen = !m.units()[static_cast<size_t>(fn)].trainable;  // LoRA: d x_L only
  compute([&] { m.head(mem_.stream(Side::compute), targets, w_fn, w_head, g_fn, g_head, grad_scale, overwrite, frozen); });
  units_.close_head_grads();
  units_.drop_head_weights(last);
  units_.drop_weights(fn, last);
  units_.finish_head_grads();
}

void StepDriver::blocks_backward(int64_t first, int64_t end, bool last) {
  Transformer& m = model_;
  for (int64_t l = end - 1; l >= first; --l) {
    const int u = m.block_unit(l), li = m.activation_index(l);
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
}

void StepDriver::pipeline_step(const PipelineInputs& in, float grad_scale, double* norm2) {
  const PipelineStage& pp = model_.pipeline();
  const int64_t M = in.micro_batches;
  if (!pp.on() || M < 1 || std::min<int64_t>(pp.size - pp.rank, M) > pp.slots)
    throw std::logic_error("StepDriver: pipeline step of " + std::to_string(M) + " micro-batches on stage " +
                           std::to_string(pp.rank) + " of " + std::to_string(pp.size) + " with " +
                           std::to_string(pp.slots) + " activation slots");
  // 1F1B as Megatron-LM runs it (forward_backward_pipelining_without_interleaving): warm-up
  // forwards, then one forward and one backward at a time, then the backwards left. A stage
  // that sends to a neighbour and then waits for that neighbour posts both at once
  // (send_recv), so two neighbours never both wait in a send.
  const int64_t warm = std::min<int64_t>(pp.size - pp.rank - 1, M), steady = M - warm;
  for (int64_t i = 0; i < warm; ++i) {
    pipe_recv_forward(i);
    stage_forward(i, in);
    pipe_send_forward(-1);
  }
  if (steady > 0) pipe_recv_forward(warm);
  for (int64_t i = 0; i < steady; ++i) {
    const int64_t f = warm + i, b = i;
    stage_forward(f, in);
    pipe_send_forward(b);  // and receive b's gradient
    const bool more = i + 1 < steady;
    stage_backward(b, M, in, grad_scale, norm2, /*send_grad=*/!more);
    if (more) pipe_send_backward_recv_forward(f + 1);
  }
  for (int64_t b = steady; b < M; ++b) {
    pipe_recv_backward();
    stage_backward(b, M, in, grad_scale, norm2, /*send_grad=*/true);
  }
  pipe_drain();
}

size_t StepDriver::pipe_elems() const {
  return static_cast<size_t>(model_.dims().res_rows * model_.dims().C);
}

void StepDriver::comm_after_compute() {
  if (!pipe_events()) return;
  mem_.stream(Side::compute).record(*pipe_ev_->compute_done);
  pipe_stream().wait(*pipe_ev_->compute_done);
}

void StepDriver::record_on_comm(PipeEvent ev) {
  if (pipe_events()) pipe_stream().record(*(*pipe_ev_.*ev));
}

void StepDriver::compute_waits(PipeEvent ev) {
  if (!pipe_events()) return;
  const kernels::Runtime* rt = mem_.runtime(Side::compute);
  wait_on_stream(mem_.stream(Side::compute), *(*pipe_ev_.*ev), rt && rt->info().backend == kernels::Backend::cpu,
                 pipe_wait_ns_);
}

// Compute waits for everything the comm stream has enqueued: synchronising compute covers the
// transfers too.
void StepDriver::pipe_drain() {
  record_on_comm(&PipeEvents::comm_done);
  compute_waits(&PipeEvents::comm_done);
}

// The comm stream runs the transfers in the order the host enqueues them (every stage the same
// pairs as its neighbours); each first waits for compute's work so far, which covers every
// earlier reader and writer of the buffers it touches.
void StepDriver::pipe_recv_forward(int64_t mb) {
  Transformer& m = model_;
  const PipelineStage& pp = m.pipeline();
  if (pp.first_stage()) return;  // (its input is the embedding's)
  m.select_slot(static_cast<int>(mb % pp.slots));
  const int li = m.activation_index(pp.first);
  comm_after_compute();  // (the slot's previous micro-batch's backward has read it)
  void* x0 = mem_.acquire(Role::activations, li, Mode::write, Side::comm);
  compute([&] {
    pp.comm->recv(x0, pipe_elems(), m.dtype(), pp.rank - 1, pipe_stream());
    record_on_comm(&PipeEvents::in_ready);
  });
  mem_.release(Role::activations, li);
}

void StepDriver::pipe_send_forward(int64_t recv_grad_of) {
  Transformer& m = model_;
  const PipelineStage& pp = m.pipeline();
  if (pp.last_stage()) return;  // (its output is the head's input)
  compute([&] {
    comm_after_compute();
    if (recv_grad_of < 0) {
      pp.comm->send(m.final_residual(), pipe_elems(), m.dtype(), pp.rank + 1, pipe_stream());
    } else {
      // (the residual gradient's last reader, the previous backward, is in compute's work so far)
      pp.comm->send_recv(m.final_residual(), pipe_elems(), pp.rank + 1, m.residual_grad(), pipe_elems(), pp.rank + 1,
                         m.dtype(), pipe_stream());
      record_on_comm(&PipeEvents::grad_ready);
    }
    record_on_comm(&PipeEvents::out_free);
  });
}

void StepDriver::pipe_recv_backward() {
  Transformer& m = model_;
  const PipelineStage& pp = m.pipeline();
  if (pp.last_stage()) return;  // (the head phase makes it)
  compute([&] {
    comm_after_compute();
    pp.comm->recv(m.residual_grad(), pipe_elems(), m.dtype(), pp.rank + 1, pipe_stream());
    record_on_comm(&PipeEvents::grad_ready);
  });
}

void StepDriver::pipe_send_backward_recv_forward(int64_t next) {
  Transformer& m = model_;
  const PipelineStage& pp = m.pipeline();
  if (pp.first_stage()) return;
  m.select_slot(static_cast<int>(next % pp.slots));
  const int li = m.activation_index(pp.first);
  comm_after_compute();
  void* x0 = mem_.acquire(Role::activations, li, Mode::write, Side::comm);
  compute([&] {
    pp.comm->send_recv(m.residual_grad(), pipe_elems(), pp.rank - 1, x0, pipe_elems(), pp.rank - 1, m.dtype(),
                       pipe_stream());
    record_on_comm(&PipeEvents::grad_free);
    record_on_comm(&PipeEvents::in_ready);
  });
  mem_.release(Role::activations, li);
}

void StepDriver::stage_forward(int64_t mb, const PipelineInputs& in) {
  Transformer& m = model_;
  const PipelineStage& pp = m.pipeline();
  m.select_slot(static_cast<int>(mb % pp.slots));
  const int32_t* ids = in.select ? in.select(mb).first : nullptr;
  units_.begin_pass({});
  if (pp.first_stage()) {
    const int li = m.activation_index(pp.first);
    void* x0 = mem_.acquire(Role::activations, li, Mode::write, Side::compute);
    const void* w = units_.use_weights(m.embed_unit());
    compute([&] { m.embed_forward(mem_.stream(Side::compute), ids, w, x0); });
    units_.drop_weights(m.embed_unit());
    mem_.release(Role::activations, li);
  }
  if (!pp.first_stage()) compute_waits(&PipeEvents::in_ready);
  blocks_forward(pp.first, pp.end);
  units_.end_pass();
}

// The residual gradient is here (the head's, or received); send_grad: it goes to the stage
// before from here (else the caller sends it with the next forward's receive).
void StepDriver::stage_backward(int64_t mb, int64_t micro_batches, const PipelineInputs& in, float grad_scale,
                                double* norm2, bool send_grad) {
  Transformer& m = model_;
  const PipelineStage& pp = m.pipeline();
  m.select_slot(static_cast<int>(mb % pp.slots));
  const std::pair<const int32_t*, const int32_t*> io =
      in.select ? in.select(mb) : std::pair<const int32_t*, const int32_t*>{nullptr, nullptr};
  const bool first = mb == 0, last = mb + 1 == micro_batches;
  units_.begin_pass({.backward = true, .first = first, .last = last, .norm2 = norm2});
  if (pp.last_stage()) {
    // (the head writes the residual gradient: its previous send must have read it)
    compute_waits(&PipeEvents::grad_free);
    head_phase(io.second, grad_scale, last);
    if (in.losses && !mem_.dry()) in.losses(mb);
  } else {
    compute_waits(&PipeEvents::grad_ready);
  }
  blocks_backward(pp.first, pp.end, last);
  if (send_grad && !pp.first_stage())
    compute([&] {
      comm_after_compute();
      pp.comm->send(m.residual_grad(), pipe_elems(), m.dtype(), pp.rank - 1, pipe_stream());
      record_on_comm(&PipeEvents::grad_free);
      // (the tied embedding's sum below runs on compute after this stage's last send has gone:
      // the first stage's last backward waits for that send)
      if (last && m.tied_head() && in.embed_group) compute_waits(&PipeEvents::grad_free);
    });
  // The tied embedding's gradient, summed over its two copies (first and last stage) once final,
  // after this stage's last send (the first stage's backward waits for it).
  const int eu = m.embed_unit();
  const auto tie = [&](float* g) {
    if (g && last && m.tied_head() && in.embed_group)
      compute([&] {
        in.embed_group->all_reduce(g, g, static_cast<size_t>(m.units()[static_cast<size_t>(eu)].n_real), DType::f32,
                                   mem_.stream(Side::compute));
      });
  };
  if (pp.first_stage()) {
    float* g = units_.open_grads(eu);
    const bool overwrite = units_.overwrites();
    if (g) compute([&] { m.embed_backward(mem_.stream(Side::compute), io.first, g, overwrite); });  // null: frozen
    tie(g);
    units_.close_grads(eu);
    units_.finish_grads(eu);
  } else if (m.tied_head()) {  // the head phase wrote the last stage's copy: nothing adds to it here
    float* g = units_.open_grads(eu);
    tie(g);
    units_.close_grads(eu);
    units_.finish_grads(eu);
  }
  units_.end_pass();
}

void StepDriver::optimizer(const AdamWStep& st, bool apply) { units_.optimizer(st, apply); }

}  // namespace strata
