// Timeline: a planned step replayed against a clock (see timeline.h).
#include "offload/timeline.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

namespace strata::offload {
namespace {

class Clock {
 public:
  Clock(const Residency& start, const LinkRates& rates)
      : r_(start), rates_(rates), ready_(start.n_blocks()), done_(start.n_blocks(), 0.0) {}

  // One step of `s` under plan `p` (made for the state the clock is in); returns its length.
  double step(const Schedule& s, const Plan& p, std::span<const double> compute_after_ms, StepTimeline& t) {
    const double begin = comp_;
    host_ = std::max(host_, comp_);  // the trainer synchronises at the end of each step
    apply_all(p.start);
    const auto& ev = s.events();
    for (size_t i = 0; i < ev.size(); ++i) {
      const ScheduleEvent& e = ev[i];
      if (!e.release) {
        apply_all(p.before[i]);
        r_.acquire(e.block, e.tier, e.mode);
        const double ready = ready_[e.block][index(e.tier)];
        if (ready > host_) {  // the trainer finishes what compute has queued, then waits
          const double from = std::max(host_, comp_);
          if (ready > from) t.stall_ms += ready - from;
          host_ = std::max(from, ready);
        }
        open_.push_back(e.block);
      } else {
        r_.release(e.block, e.tier, e.mode);
        if (e.discard) r_.discard(e.block);
        open_.erase(std::find(open_.begin(), open_.end(), e.block));
      }
      apply_all(p.after[i]);
      const double ms = i < compute_after_ms.size() ? compute_after_ms[i] : 0.0;
      if (ms > 0) {
        comp_ = std::max(comp_, host_) + ms;
        t.compute_ms += ms;
        for (BlockId b : open_) done_[b] = comp_;
      }
    }
    return comp_ - begin;
  }

  const Residency& residency() const { return r_; }
  double nvme_busy_ms() const { return nvme_busy_; }

 private:
  // A move on its link: starts when the link is free and `dep` has passed; returns its end.
  double move(const Move& m, double dep) {
    const bool to_nvme = m.to == Tier::nvme, from_nvme = m.from == Tier::nvme;
    double at = dep;
    auto run = [&](double& queue, double rate, bool nvme) {
      if (rate <= 0) return;
      const double ms = static_cast<double>(m.bytes) / rate;
      at = std::max(at, queue) + ms;
      queue = at;
      if (nvme) nvme_busy_ += ms;
    };
    // A device<->NVMe move is staged through the host: both of its links, one after the other.
    if (m.from == Tier::device) run(d2h_, rates_.d2h, false);
    if (to_nvme) run(nvme_, rates_.nvme_write, true);
    if (from_nvme) run(nvme_, rates_.nvme_read, true);
    if (m.to == Tier::device) run(h2d_, rates_.h2d, false);
    ready_[m.block][index(m.to)] = at;
    return at;
  }

  void apply_all(const std::vector<PlanOp>& ops) {
    double freed = host_;  // the evictions so far in this list have given their room back
    for (const PlanOp& op : ops) {
      switch (op.kind) {
        case OpKind::evict: {
          // Compute must be done with the copy; a write-back sends its bytes home first.
          double at = std::max(host_, done_[op.block]);
          at = std::max(at, ready_[op.block][index(op.tier)]);
          for (const Move& m : r_.evict(op.block, op.tier).moves) at = std::max(at, move(m, at));
          freed = std::max(freed, at);
          break;
        }
        case OpKind::load:
          for (const Move& m : r_.load(op.block, op.tier).moves)
            move(m, std::max(freed, ready_[op.block][index(m.from)]));
          break;
        case OpKind::alloc:
          r_.alloc(op.block, op.tier);
          ready_[op.block][index(op.tier)] = freed;
          break;
      }
    }
  }

  Residency r_;
  LinkRates rates_;
  std::vector<std::array<double, kNumTiers>> ready_;  // [block][tier]: the copy is current from then
  std::vector<double> done_;                          // [block]: compute's last use of it ends
  std::vector<BlockId> open_;                         // acquired, not yet released
  double host_ = 0, comp_ = 0;                        // the trainer's thread; the compute stream
  double nvme_ = 0, h2d_ = 0, d2h_ = 0;               // each link's queue is free from then
  double nvme_busy_ = 0;
};

Plan choose(const Residency& state, const Schedule& s) {
  auto cands = candidate_plans(state, s);
  if (cands.empty()) check_budgets(state, s);  // throws, naming the minimum
  if (cands.empty()) throw std::logic_error("offload: no plan runs the schedule, yet every budget passes");
  return std::move(cands.front());
}

}  // namespace

StepTimeline estimate_step(const Residency& start, const Schedule& s, std::span<const double> compute_after_ms,
                           const LinkRates& rates) {
  Clock clock(start, rates);
  StepTimeline first, second;
  clock.step(s, choose(start, s), compute_after_ms, first);
  const double busy = clock.nvme_busy_ms();
  second.step_ms = clock.step(s, choose(clock.residency(), s), compute_after_ms, second);
  second.nvme_busy_ms = clock.nvme_busy_ms() - busy;
  return second;
}

}  // namespace strata::offload
