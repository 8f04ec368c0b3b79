// The per-unit ZeRO lifecycle: the stage's weight and gradient paths, the pending and in-backward
// updates, the collectives on the comm stream and the events that order them against compute.
#include "src/zero/unit_lifecycle.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <stdexcept>
#include <string>

#include "src/zero/unit_table.h"

namespace strata {
using offload::Mode;

namespace {
const char* state_name(UnitLifecycle::Weights s) { return s == UnitLifecycle::Weights::resting ? "resting" : "in_use"; }
const char* state_name(UnitLifecycle::Grads s) {
  return s == UnitLifecycle::Grads::idle ? "idle" : s == UnitLifecycle::Grads::writing ? "writing" : "written";
}
}  // namespace

// How a stage brings a unit's working weights to a compute phase and takes them back.
class UnitLifecycle::WeightPath {
 public:
  explicit WeightPath(UnitLifecycle& lc) : lc_(lc) {}
  virtual ~WeightPath() = default;
  // The pass's uses that need preparing, in the order the phases use the units.
  virtual void plan_uses(bool backward) = 0;
  virtual const void* use(int u) = 0;
  // False: the unit stays in use (stage 3: a tied head's embedding, kept for the head phase).
  virtual bool drop(int u, bool spent) = 0;
  virtual const void* use_head() { return lc_.use_weights(lc_.model_.head_unit()); }

 protected:
  // The next use if it is unit u's: prepared (and the one after it, so that unit's weights come
  // while this one computes), compute waiting until it is ready.
  const Use* take(int u) {
    if (lc_.cursor_ >= lc_.uses_.size() || lc_.uses_[lc_.cursor_].unit != u) return nullptr;
    const size_t i = lc_.cursor_++;
    lc_.prepare(i);
    const Use& x = lc_.uses_[i];
    if (x.ready) lc_.compute([&] { lc_.await_on_compute(*x.ready); });
    if (lc_.overlap()) lc_.prepare(i + 1);
    return &x;
  }
  // The forward's units in order of use, each with the pending update where there is one.
  void forward_uses(bool gather, std::array<int, kNumUnitSlots>& turn) {
    const Transformer& m = lc_.model_;
    auto add = [&](int u) {
      Use x;
      x.unit = u;
      x.update = lc_.pass_.update != nullptr && lc_.trains(u);
      x.gather = gather;
      if (gather) x.slot = lc_.gather_slot(u, turn);
      if (x.update || x.gather) lc_.uses_.push_back(x);
    };
    add(m.embed_unit());
    for (int64_t l = 0; l < m.dims().L; ++l) {
      add(m.block_unit(l));
      if (m.lora()) add(m.lora_unit(l));  // the layer's adapters, used with it
    }
    add(m.final_norm_unit());
    if (!m.tied_head()) add(m.head_unit());  // a tied head is the embedding: updated and gathered already
  }
  UnitLifecycle& lc_;
};

// Stages 0-2: the weights block is the whole unit; a phase acquires and releases it.
class UnitLifecycle::WholeWeights final : public UnitLifecycle::WeightPath {
 public:
  using WeightPath::WeightPath;
  void plan_uses(bool) override {
    std::array<int, kNumUnitSlots> turn{};
    forward_uses(false, turn);
  }
  const void* use(int u) override {
    take(u);
    const void* w = lc_.mem_.acquire(Role::params, u, Mode::read, Side::compute);
    if (!lc_.model_.stored_unit(u)) return w;
    // LoRA --base-dtype: the layer decoded into a slot, in compute's order (the slot's previous
    // layer is done with it by then).
    void* out = lc_.mem_.decoded(lc_.next_decoded_++ % 2);
    lc_.compute([&] { lc_.model_.decode_unit(lc_.mem_.stream(Side::compute), lc_.mem_.ops(Side::compute), u, w, out); });
    return out;
  }
  bool drop(int u, bool spent) override {
    // Spent weights the update rewrites are dropped, not written home; a frozen unit's stay.
    if (spent && lc_.trains(u) && !lc_.mem_.master_is_weights())
      lc_.mem_.release_discard(Role::params, u);
    else
      lc_.mem_.release(Role::params, u);
    return true;
  }
};

// Stage 3: the weights block is this rank's shard; before each use every rank's shard is
// all-gathered into a whole-unit slot (RunMemory::gathered), which the next unit reuses.
class UnitLifecycle::GatheredWeights final : public UnitLifecycle::WeightPath {
 public:
  using WeightPath::WeightPath;
  void plan_uses(bool backward) override {
    std::array<int, kNumUnitSlots> turn{};
    forward_uses(true, turn);
    if (!backward) return;
    const Transformer& m = lc_.model_;
    for (int64_t l = m.dims().L - 1; l >= 0; --l)  // gathered again: the recompute and backward use it
      for (int u : {m.block_unit(l), m.lora_unit(l)}) {
        if (u < 0) continue;  // no adapters
        Use x;
        x.unit = u;
        x.gather = true;
        x.slot = lc_.gather_slot(u, turn);
        lc_.uses_.push_back(x);
      }
  }
  const void* use(int u) override {
    const Use* x = take(u);
    if (!x) lc_.out_of_order(u, "use_weights (stage 3: not gathered)");
    lc_.held_.emplace_back(u, x->slot);
    return lc_.mem_.gathered(x->slot);
  }
  bool drop(int u, bool) override {
    const Transformer& m = lc_.model_;
    auto it = std::find_if(lc_.held_.begin(), lc_.held_.end(), [u](const auto& h) { return h.first == u; });
    if (it == lc_.held_.end()) lc_.out_of_order(u, "drop_weights (stage 3: not gathered)");
    // A tied head: the embedding stays gathered until the head phase is done.
    if (u == m.embed_unit() && m.tied_head() && !lc_.held_head_) {
      lc_.held_head_ = true;
      return false;
    }
    const int slot = it->second;
    lc_.held_.erase(it);
    if (u == m.embed_unit()) lc_.held_head_ = false;
    lc_.compute([&] { lc_.mem_.stream(Side::compute).record(*lc_.slot_free_ev_[static_cast<size_t>(slot)]); });
    return true;
  }
  // A tied head: the embedding is still whole in slot 0 from this pass's embedding forward
  // (nothing else uses slot 0, and its update ran before that forward), so the head phase uses
  // it as it is, without gathering it again.
  const void* use_head() override {
    if (!lc_.model_.tied_head()) return WeightPath::use_head();
    if (!lc_.held_head_) lc_.out_of_order(lc_.model_.head_unit(), "use_head_weights (the embedding is not kept)");
    return lc_.mem_.gathered(0);
  }
};

// How a stage carries a unit's gradient from its backward to its grads block.
class UnitLifecycle::GradPath {
 public:
  explicit GradPath(UnitLifecycle& lc) : lc_(lc) {}
  virtual ~GradPath() = default;
  // adds: the backward adds to what the head phase wrote (the tied embedding).
  virtual float* open(int u, bool adds) = 0;
  virtual bool overwrites() const = 0;
  virtual void close(int u) = 0;
  virtual void close_head() = 0;
  virtual void finish(int u) = 0;

 protected:
  UnitLifecycle& lc_;
};

// Stages 0-1: the backward writes the grads block itself; on the last micro-batch its Σ g² is
// taken (one rank) or it is all-reduced (world > 1). An update in the backward follows.
class UnitLifecycle::WholeGrads final : public UnitLifecycle::GradPath {
 public:
  using GradPath::GradPath;
  float* open(int u, bool adds) override {
    const Mode mode = adds ? Mode::read_write : lc_.pass_.first ? Mode::write : Mode::read_write;
    return static_cast<float*>(lc_.mem_.acquire(Role::grads, u, mode, Side::compute));
  }
  bool overwrites() const override { return lc_.pass_.first; }
  void close(int u) override {
    norm(u);
    reduce(u);
    lc_.mem_.release(Role::grads, u);
  }
  // The final norm's, then an untied head's (a tied head's with the embedding's); released in
  // reverse.
  void close_head() override {
    const Transformer& m = lc_.model_;
    const int fn = m.final_norm_unit(), hu = m.head_unit();
    const bool f = lc_.trains(fn), h = lc_.trains(hu);  // frozen (LoRA): no grads to close
    if (f) norm(fn);
    if (h && !m.tied_head()) norm(hu);
    if (f) reduce(fn);
    if (h && !m.tied_head()) reduce(hu);
    if (h) lc_.mem_.release(Role::grads, hu);
    if (f) lc_.mem_.release(Role::grads, fn);
  }
  void finish(int u) override {
    if (lc_.pass_.update_now) lc_.update_unit(u, *lc_.pass_.update_now, true);
  }

 private:
  void norm(int u) {
    if (!lc_.pass_.last || lc_.sh_.world != 1) return;
    lc_.compute([&] {
      lc_.model_.grad_sum_squares(lc_.mem_.stream(Side::compute), u, lc_.open_[static_cast<size_t>(u)],
                                  lc_.pass_.norm2 + u);
    });
  }
  void reduce(int u) {
    if (lc_.pass_.last && lc_.sh_.world > 1)
      lc_.reduce_grads_async(u, lc_.open_[static_cast<size_t>(u)], lc_.pass_.norm2 + u);
  }
};

// Stages 2-3: the backward writes the whole unit's grads into a scratch slot (every
// micro-batch as if it were the first), reduce-scattered on the comm stream into the grads
// block, which keeps only this rank's shard.
class UnitLifecycle::ScatteredGrads final : public UnitLifecycle::GradPath {
 public:
  using GradPath::GradPath;
  float* open(int u, bool adds) override {
    if (adds) return lc_.mem_.grad_scratch(lc_.scratch_of_[static_cast<size_t>(u)]);  // the head wrote it
    const int slot = lc_.next_scratch_slot(u);
    lc_.scratch_of_[static_cast<size_t>(u)] = slot;
    return lc_.scratch_for(slot);
  }
  bool overwrites() const override { return true; }
  void close(int) override {}
  void close_head() override {}
  void finish(int u) override { lc_.reduce_scatter_async(u, lc_.scratch_of_[static_cast<size_t>(u)]); }
};

UnitLifecycle::UnitLifecycle(Transformer& model, RunMemory& mem, Communicator* comm)
    : model_(model), mem_(mem), sh_(mem.units().sharding()), comm_(comm) {
  if (sh_.sharded_weights())
    weights_path_ = std::make_unique<GatheredWeights>(*this);
  else
    weights_path_ = std::make_unique<WholeWeights>(*this);
  if (sh_.sharded_grads())
    grads_path_ = std::make_unique<ScatteredGrads>(*this);
  else
    grads_path_ = std::make_unique<WholeGrads>(*this);
  const size_t n = model_.units().size();
  weights_.assign(n, Weights::resting);
  grads_.assign(n, Grads::idle);
  open_.assign(n, nullptr);
  scratch_of_.assign(n, -1);
  if (mem_.dry() || !overlap()) return;
  kernels::Runtime* rt = mem_.runtime(Side::compute);
  if (!rt) return;
  for (auto* set : {&gathered_ev_, &slot_free_ev_, &scratch_read_ev_})
    for (auto& e : *set) e = rt->create_event();
  for (auto& e : ready_ev_) e = rt->create_event();
  for (Side side : {Side::compute, Side::optimizer, Side::comm})
    if (kernels::Runtime* r = mem_.runtime(side)) order_ev_[static_cast<size_t>(side)] = r->create_event();
  timed_waits_ = rt->info().backend == kernels::Backend::cpu;
}

UnitLifecycle::~UnitLifecycle() = default;

bool UnitLifecycle::trains(int u) const { return mem_.units()[u].trainable; }

std::string UnitLifecycle::name(int u) const { return model_.units().at(static_cast<size_t>(u)).name; }

void UnitLifecycle::out_of_order(int u, const char* call) const {
  const auto i = static_cast<size_t>(u);
  throw std::logic_error(std::string("UnitLifecycle: ") + call + " of unit " + name(u) + " out of order (weights " +
                         state_name(weights_.at(i)) + ", grads " + state_name(grads_.at(i)) + ")");
}

void UnitLifecycle::begin_pass(const UnitPass& pass) {
  if (pass.update_now && (!pass.last || sh_.sharded_grads() || pass.update))
    throw std::logic_error(
        "StepDriver: an update in the backward needs the last micro-batch, whole grads (stage 0-1) and no pending update");
  pass_ = pass;
  uses_.clear();  // (a pass that failed half way may have left some)
  held_.clear();
  held_head_ = false;
  cursor_ = 0;
  std::fill(weights_.begin(), weights_.end(), Weights::resting);
  std::fill(grads_.begin(), grads_.end(), Grads::idle);
  weights_path_->plan_uses(pass.backward);
}

void UnitLifecycle::end_pass() {
  if (cursor_ != uses_.size() || !held_.empty())
    throw std::logic_error("StepDriver: a pass ended with weights not used (" + std::to_string(uses_.size() - cursor_) +
                           ") or still held (" + std::to_string(held_.size()) + ")");
  for (size_t u = 0; u < weights_.size(); ++u)
    if (weights_[u] != Weights::resting || grads_[u] != Grads::idle) out_of_order(static_cast<int>(u), "end_pass");
  if (!overlap()) return;
  compute([&] {
    kernels::Stream& c = mem_.stream(Side::comm);
    if (&c == &mem_.stream(Side::compute)) return;
    kernels::Event& e = *order_ev_[static_cast<size_t>(Side::comm)];
    c.record(e);
    await_on_compute(e);
  });
}

const void* UnitLifecycle::use_weights(int u) {
  Weights& s = weights_.at(static_cast<size_t>(u));
  if (s != Weights::resting) out_of_order(u, "use_weights");
  s = Weights::in_use;
  return weights_path_->use(u);
}

void UnitLifecycle::drop_weights(int u, bool spent) {
  Weights& s = weights_.at(static_cast<size_t>(u));
  if (s != Weights::in_use) out_of_order(u, "drop_weights");
  if (weights_path_->drop(u, spent)) s = Weights::resting;
}

const void* UnitLifecycle::use_head_weights() { return weights_path_->use_head(); }

void UnitLifecycle::drop_head_weights(bool spent) { drop_weights(model_.head_unit(), spent); }

float* UnitLifecycle::open_grads(int u) {
  Grads& s = grads_.at(static_cast<size_t>(u));
  // The tied embedding's backward adds to what the head phase wrote.
  const bool adds = u == model_.embed_unit() && model_.tied_head() && s == Grads::written;
  if (s != Grads::idle && !adds) out_of_order(u, "open_grads");
  s = Grads::writing;
  if (!trains(u)) return open_[static_cast<size_t>(u)] = nullptr;  // frozen: the input gradient only
  return open_[static_cast<size_t>(u)] = grads_path_->open(u, adds);
}

bool UnitLifecycle::overwrites() const { return grads_path_->overwrites(); }

void UnitLifecycle::close_grads(int u) {
  Grads& s = grads_.at(static_cast<size_t>(u));
  if (s != Grads::writing) out_of_order(u, "close_grads");
  if (trains(u)) grads_path_->close(u);
  s = Grads::written;
}

void UnitLifecycle::finish_grads(int u) {
  Grads& s = grads_.at(static_cast<size_t>(u));
  if (s != Grads::written) out_of_order(u, "finish_grads");
  if (trains(u)) grads_path_->finish(u);
  s = Grads::idle;
}

std::pair<float*, float*> UnitLifecycle::open_head_grads() {
  float* g_fn = open_grads(model_.final_norm_unit());
  return {g_fn, open_grads(model_.head_unit())};
}

void UnitLifecycle::close_head_grads() {
  const int fn = model_.final_norm_unit(), hu = model_.head_unit();
  for (int u : {fn, hu})
    if (grads_.at(static_cast<size_t>(u)) != Grads::writing) out_of_order(u, "close_head_grads");
  grads_path_->close_head();
  grads_[static_cast<size_t>(fn)] = grads_[static_cast<size_t>(hu)] = Grads::written;
}

// A tied head's gradient is the embedding's: it is finished with the embedding's backward.
void UnitLifecycle::finish_head_grads() {
  finish_grads(model_.final_norm_unit());
  if (!model_.tied_head()) finish_grads(model_.head_unit());
}

void UnitLifecycle::optimizer(const AdamWStep& st, bool apply) {
  for (size_t ui = 0; ui < model_.units().size(); ++ui)
    if (trains(static_cast<int>(ui))) update_unit(static_cast<int>(ui), st, apply);
  end_pass();
}

// Slots 1 and 3 are pairs: their units take turns between the slot and the one after it.
int UnitLifecycle::gather_slot(int u, std::array<int, kNumUnitSlots>& turn) const {
  const int slot = unit_slot(model_, u);
  if (slot != 1 && slot != 3) return slot;
  return slot + turn[static_cast<size_t>(slot)]++ % 2;
}

int UnitLifecycle::next_scratch_slot(int u) { return gather_slot(u, scratch_turn_); }

float* UnitLifecycle::scratch_for(int slot) {
  compute([&] { await_on_compute(*scratch_read_ev_[static_cast<size_t>(slot)]); });
  return mem_.grad_scratch(slot);
}

void UnitLifecycle::prepare(size_t i) {
  if (i >= uses_.size() || uses_[i].prepared) return;
  Use& x = uses_[i];
  x.prepared = true;
  if (x.update) x.ready = update_unit(x.unit, pass_.update->st, pass_.update->apply, pass_.update->restore);
  if (!x.gather) return;
  // Stage 3: every rank's shard, in rank order, into the slot's whole-unit buffer once compute
  // is done with the slot's previous unit. The shard block is released once the gather has
  // read it (in the comm stream's order).
  void* whole = mem_.gathered(x.slot);
  compute([&] { mem_.stream(Side::comm).wait(*slot_free_ev_[static_cast<size_t>(x.slot)]); });
  const void* w = mem_.acquire(Role::params, x.unit, Mode::read, Side::comm);
  compute([&] {
    kernels::Stream& c = mem_.stream(Side::comm);
    comm_->all_gather(w, whole, static_cast<size_t>(mem_.units()[x.unit].params.n), model_.dtype(), c);
    c.record(*gathered_ev_[static_cast<size_t>(x.slot)]);
  });
  mem_.release(Role::params, x.unit);
  x.ready = mem_.dry() ? nullptr : gathered_ev_[static_cast<size_t>(x.slot)].get();
}

void UnitLifecycle::order(Side from, Side to) {
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
void wait_on_stream(kernels::Stream& stream, kernels::Event& ev, bool timed,
                    const std::shared_ptr<std::atomic<int64_t>>& waited_ns) {
  if (!timed) {
    stream.wait(ev);
    return;
  }
  std::shared_ptr<kernels::EventPoint> p = ev.point();
  if (!p) return;  // never recorded: nothing to wait for
  stream.host_fn([p, acc = waited_ns] {
    const auto t0 = std::chrono::steady_clock::now();
    std::exception_ptr err = p->wait_host();
    acc->fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    if (err) std::rethrow_exception(err);  // the awaited work (a collective, a transfer) failed: so does this
  });
}

void UnitLifecycle::await_on_compute(kernels::Event& ev) {
  wait_on_stream(mem_.stream(Side::compute), ev, timed_waits_, exposed_ns_);
}

void UnitLifecycle::reduce_grads_async(int u, float* g, double* norm2) {
  // Stages 0 and 1: every rank gets the whole sum (fixed rank order, so bitwise what a
  // reduce-scatter gives each shard). The norm takes only this rank's shard, so that every
  // stage sums the same shard sums in the same order.
  order(Side::compute, Side::comm);
  mem_.handoff(Role::grads, u, Side::comm);
  compute([&] {
    kernels::Stream& c = mem_.stream(Side::comm);
    const UnitEntry& e = mem_.units()[u];
    comm_->all_reduce(g, g, static_cast<size_t>(e.grads.n), DType::f32, c);
    const int64_t lo = e.shards.dp.offset;
    model_.grad_sum_squares(mem_.ops(Side::comm), c, u, g + lo, lo, lo + e.shards.dp.shard, norm2);
  });
}

void UnitLifecycle::reduce_scatter_async(int u, int slot) {
  order(Side::compute, Side::comm);  // the backward has written the slot
  const Mode gmode = pass_.first ? Mode::write : Mode::read_write;
  float* g = static_cast<float*>(mem_.acquire(Role::grads, u, gmode, Side::comm));
  compute([&] {
    kernels::Stream& c = mem_.stream(Side::comm);
    shard_grads(c, u, mem_.grad_scratch(slot), g, pass_.norm2 + u);
    c.record(*scratch_read_ev_[static_cast<size_t>(slot)]);
  });
  mem_.release(Role::grads, u);
}

// Stages 2-3: the unit's whole grads of this micro-batch (in `whole`, a scratch) are summed
// across ranks into this rank's shard (reduce-scatter, in place), which is stored in (first) or
// added to the shard grads block; on the last micro-batch the shard's Σ g² goes to *norm2.
void UnitLifecycle::shard_grads(kernels::Stream& s, int u, float* whole, float* shard, double* norm2) {
  const UnitEntry& e = mem_.units()[u];
  const int64_t S = e.shards.dp.shard, lo = e.shards.dp.offset;
  float* mine = whole + lo;
  kernels::Ops& ops = mem_.ops(Side::comm);
  comm_->reduce_scatter(whole, mine, static_cast<size_t>(S), DType::f32, s);  // in place
  if (pass_.first)
    s.memcpy_async(shard, mine, static_cast<size_t>(S) * 4);
  else
    ops.add(s, {.dtype = DType::f32, .n = S, .a = shard, .b = mine, .out = shard});
  if (pass_.last) model_.grad_sum_squares(ops, s, u, shard, lo, lo + S, norm2);
}

kernels::Event* UnitLifecycle::update_unit(int u, const AdamWStep& st, bool apply, bool restore) {
  const Transformer& m = model_;
  const bool aliased = mem_.master_is_weights();
  const DType dt = m.dtype();
  const size_t esz = kernels::dtype_size(dt);
  const Unit& unit = m.units()[static_cast<size_t>(u)];
  const UnitEntry& e = mem_.units()[u];
  // This rank's part of the unit: the master's elements [lo, lo + n), with the AdamW state
  // over the same elements; the grads and weights blocks hold e.grads and e.params of the
  // unit. Where the update writes only part of a whole weights block, every rank's new part is
  // then all-gathered into it on the comm stream (stages 1, 2); stage 3's weights block is the
  // shard itself (gathered when a phase uses the unit).
  const int64_t n = e.master.n, lo = e.master.lo;
  const bool gather = e.gathers_after_update();
  // Speculation: the current copies are read, the other ones (index u + units) written whole:
  // the same AdamW, bit for bit. A restore reads the current master alone.
  const bool two = mem_.units().two_copies() && !restore;
  if (restore && (!mem_.units().two_copies() || aliased))
    throw std::logic_error("UnitLifecycle: a restore needs the master apart from the weights (speculation)");
  const int next = u + static_cast<int>(mem_.units().size());
  // AdamW next to the state: state on the device (all of it, or Twin-Flow's units) updates on
  // the compute stream, in order with the kernels that read the weights; state off it on the
  // optimizer's side (the CPU, beside a GPU). (With the whole optimizer on the device the two
  // sides are one stream.)
  const Side side = e.master.home == offload::Tier::device ? Side::compute : Side::optimizer;
  const float* master_now = two ? static_cast<const float*>(mem_.acquire(Role::master, u, Mode::read, side)) : nullptr;
  const float* adam_now = two ? static_cast<const float*>(mem_.acquire(Role::adam, u, Mode::read, side)) : nullptr;
  const Mode own = restore ? Mode::read : two ? Mode::write : Mode::read_write;
  float* master = static_cast<float*>(mem_.acquire(Role::master, two ? next : u, own, side));
  float* adam = restore ? nullptr : static_cast<float*>(mem_.acquire(Role::adam, two ? next : u, own, side));
  const float* g =
      restore ? nullptr : static_cast<const float*>(mem_.acquire(Role::grads, u, Mode::read, side));
  // The new working weights: written whole (parameters by AdamW, padding zeroed here, the
  // other ranks' shards by the all-gather; stage 3: the block is this rank's shard).
  void* w = aliased ? nullptr : mem_.acquire(Role::params, u, Mode::write, side);
  // ws: element lo of the unit's working weights
  char* ws = w ? static_cast<char*>(w) + static_cast<size_t>(lo - e.params.lo) * esz : nullptr;
  compute([&] {
    kernels::Stream& s = mem_.stream(side);
    kernels::Ops& ops = mem_.ops(side);
    const AdamLayout al = e.adam_layout();
    float* mm = adam ? adam + al.m_offset() : nullptr;
    float* vv = adam ? adam + al.v_offset() : nullptr;
    const float* gs = restore ? nullptr : g + (lo - e.grads.lo);  // element lo of the unit's grads
    if (two && !apply) {
      s.memcpy_async(master, master_now, mem_.units().bytes(Role::master, u));
      s.memcpy_async(adam, adam_now, mem_.units().bytes(Role::adam, u));
    }
    if (!apply || restore) {
      if (w) ops.cast(s, {.n = n, .src = master, .src_dtype = DType::f32, .dst = ws, .dst_dtype = dt});
    } else {
      // Two copies: AdamW reads the current one and writes the other (no copy first); what no
      // range updates (padding) is copied, so the other copy ends whole, as a copy then an
      // in-place update would leave it.
      const float* mm_now = two ? adam_now + al.m_offset() : nullptr;
      const float* vv_now = two ? adam_now + al.v_offset() : nullptr;
      int64_t copied_to = 0;  // elements [0, copied_to) of the shard are covered
      const auto copy_gap = [&](int64_t a, int64_t b) {
        if (!two || b <= a) return;
        const size_t bytes = static_cast<size_t>(b - a) * sizeof(float);
        s.memcpy_async(master + a, master_now + a, bytes);
        s.memcpy_async(mm + a, mm_now + a, bytes);
        s.memcpy_async(vv + a, vv_now + a, bytes);
      };
      // The unit's decay ranges, cut at the shard's bounds (in order, disjoint).
      for (const UnitRange& r : unit.adamw_ranges) {
        const int64_t a = std::max(r.offset, lo), b = std::min(r.offset + r.numel, lo + n);
        if (b <= a) continue;
        const int64_t k = a - lo;
        copy_gap(copied_to, k);
        copied_to = std::max(copied_to, b - lo);
        const AdamWFrom from = two ? AdamWFrom{master_now + k, mm_now + k, vv_now + k} : AdamWFrom{};
        adamw_range(ops, s, st, r.decay, b - a, master + k, mm + k, vv + k, gs + k,
                    ws ? ws + static_cast<size_t>(k) * esz : nullptr, dt, from);
      }
      copy_gap(copied_to, n);
      const int64_t pad = std::max(unit.n_real, lo);
      if (ws && lo + n > pad)
        s.memset_async(ws + static_cast<size_t>(pad - lo) * esz, 0, static_cast<size_t>(lo + n - pad) * esz);
    }
  });
  kernels::Event* ready = nullptr;
  if (gather) {  // the other ranks' new shards, on the comm stream once this shard is written
    order(side, Side::comm);
    mem_.handoff(Role::params, u, Side::comm);
    compute([&] {
      kernels::Stream& c = mem_.stream(Side::comm);
      comm_->all_gather(ws, w, static_cast<size_t>(n), dt, c);
      if (ready_ev_[0]) {
        ready = ready_ev_[next_ready_++ % ready_ev_.size()].get();
        c.record(*ready);
      }
    });
  }
  if (!aliased) mem_.release(Role::params, u);
  // The gradients are spent: the next step's backward overwrites them before anything reads
  // them, so an offloaded copy is dropped instead of written home (a rolled-back speculative
  // update computes them again: Trainer::step).
  if (!restore) {
    mem_.release_discard(Role::grads, u);
    mem_.release(Role::adam, two ? next : u);
  }
  mem_.release(Role::master, two ? next : u);
  if (two) {
    mem_.release(Role::adam, u);
    mem_.release(Role::master, u);
  }
  return ready;
}

}  // namespace strata
