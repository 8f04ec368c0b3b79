// UnitTable: the per-unit facts from the model, the placement and the sharding.
#include "src/zero/unit_table.h"

#include <stdexcept>

#include "kernels/dtype.h"

namespace strata {

const UnitBlock& UnitEntry::block(Role r) const {
  switch (r) {
    case Role::params: return params;
    case Role::master: return master;
    case Role::adam: return adam;
    case Role::grads: return grads;
    case Role::activations: break;
  }
  throw std::logic_error("UnitTable: unit " + name + " has no block of role " +
                         std::to_string(static_cast<int>(r)) + " (block inputs belong to layers)");
}

UnitTable::UnitTable(const Transformer& model, const Placement& pl, const std::vector<bool>& trainable)
    : sh_(pl.sharding), dtype_(model.dtype()) {
  if (!trainable.empty() && trainable.size() != model.units().size())
    throw std::logic_error("UnitTable: " + std::to_string(trainable.size()) + " trainable flags for " +
                           std::to_string(model.units().size()) + " units");
  // One fp32 block for both where they cover the same elements on the same tier: the whole
  // unit (unsharded), or at stage 3 this rank's shard of each (the working weights are
  // gathered from the shards when used, so the master shard can be the weights shard).
  // (Not with speculation: the update writes a second master copy, the weights stay one block.)
  two_copies_ = pl.speculate;
  // (Twin-Flow: the units split between two homes, so no one block serves both.)
  const bool twin = pl.optimizer != offload::Tier::device && pl.optimizer_on_device > 0;
  master_is_weights_ = dtype_ == DType::f32 && pl.params == pl.optimizer && !pl.speculate && !twin &&
                       (!sh_.sharded_optimizer() || sh_.sharded_weights());
  std::vector<bool> trains(model.units().size());
  for (size_t u = 0; u < trains.size(); ++u) trains[u] = trainable.empty() ? model.units()[u].trainable : trainable[u];
  const std::vector<bool> on_device =
      twin ? twin_device_units(model.units(), trains, pl.optimizer_on_device) : std::vector<bool>(trains.size());
  for (size_t u = 0; u < model.units().size(); ++u) {
    const Unit& unit = model.units()[u];
    UnitEntry e;
    e.name = unit.name;
    e.numel = unit.numel;
    e.n_real = unit.n_real;
    e.trainable = trains[u];
    if (!unit.held) {  // another pipeline stage's
      e.held = e.trainable = false;
      units_.push_back(std::move(e));
      continue;
    }
    const int64_t S = sh_.shard(unit.numel);
    e.shards.dp = {.numel = unit.numel, .shard = S, .offset = sh_.rank * S};
    // A block holds the whole unit, or (its stage shards it) this rank's shard.
    const auto span = [&](bool sharded, offload::Tier home) {
      return sharded ? UnitBlock{true, e.shards.dp.offset, S, home} : UnitBlock{true, 0, unit.numel, home};
    };
    // --offload-params places the weights; under LoRA that is the frozen base: the adapters'
    // working weights are small and stay on the device (beside their master where the two are
    // one fp32 block).
    const bool adapter = model.lora() && e.trainable;
    e.params = span(sh_.sharded_weights(), adapter ? (master_is_weights_ ? pl.optimizer : offload::Tier::device)
                                                   : pl.params);
    if (model.stored_unit(static_cast<int>(u))) e.stored_bytes = model.stored_bytes(static_cast<int>(u));
    if (e.trainable) {
      e.master_is_weights = master_is_weights_;
      // (Twin-Flow's units: the state on the device, and AdamW there: UnitLifecycle::update_unit.)
      e.master = span(sh_.sharded_optimizer(), on_device[u] ? offload::Tier::device : pl.optimizer);
      e.adam = e.master;
      e.grads = span(sh_.sharded_grads(), pl.grads);
    }
    units_.push_back(std::move(e));
  }
}

std::vector<bool> twin_device_units(const std::vector<Unit>& units, const std::vector<bool>& trainable,
                                    double fraction) {
  std::vector<bool> on(units.size());
  int64_t total = 0;
  for (size_t u = 0; u < units.size(); ++u)
    if (trainable[u] && units[u].held) total += units[u].numel;
  const double limit = fraction * static_cast<double>(total);  // (exact at 0 and 1)
  int64_t taken = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    if (!trainable[u] || !units[u].held) continue;
    if (static_cast<double>(taken + units[u].numel) > limit) break;
    taken += units[u].numel;
    on[u] = true;
  }
  return on;
}

uint64_t UnitTable::bytes(Role r, int u) const {
  const UnitEntry& e = (*this)[u];
  const UnitBlock& b = e.block(r);
  if (!b.exists) return 0;
  if (r == Role::params && e.stored_bytes) return e.stored_bytes;
  const auto n = static_cast<uint64_t>(r == Role::adam ? e.adam_layout().length() : b.n);
  return n * (r == Role::params ? kernels::dtype_size(dtype_) : 4);
}

int unit_slot(const Transformer& m, int u) {
  if (u == m.embed_unit() || u == m.head_unit()) return 0;
  return m.lora() && u >= m.lora_unit(0) ? 3 : 1;
}

}  // namespace strata
