// src/zero on its own: the unit table's geometry, homes and AdamW layout per ZeRO stage, the
// step program's placement of the updates, and the unit lifecycle's checked transitions.
#include <gtest/gtest.h>

#include <string>

#include "kernels/runtime.h"
#include "offload/size.h"
#include "src/train/flat_memory.h"
#include "src/train/tiered_memory.h"
#include "src/zero/step_program.h"
#include "src/zero/unit_lifecycle.h"
#include "src/zero/unit_table.h"

namespace strata {
namespace {

using offload::Tier;

ModelConfig tiny_llama() {
  ModelConfig c = default_model_config();
  c.hidden_size = 32, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 8;
  c.intermediate_size = 64, c.max_position_embeddings = 64;
  return c;
}

// Each stage shards what DESIGN.md says (run_memory.h Sharding): 1 the master and AdamW state,
// 2 also the grads, 3 also the weights; every block has its state's home.
TEST(ZeroUnitTable, EachStageShardsItsStatesAndHomesThemByPlacement) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  Transformer model(tiny_llama(), DType::bf16, 1, 8, *rt, {}, kLogitsChunkBytes, 2);
  for (int stage = 0; stage <= 3; ++stage) {
    Placement pl;
    pl.params = Tier::host, pl.grads = Tier::nvme, pl.optimizer = Tier::device;
    pl.sharding = {stage, 2, 1};
    const UnitTable t(model, pl);
    ASSERT_EQ(t.size(), model.units().size());
    EXPECT_FALSE(t.master_is_weights());
    for (int u = 0; u < static_cast<int>(t.size()); ++u) {
      const UnitEntry& e = t[u];
      const Unit& unit = model.units()[static_cast<size_t>(u)];
      const int64_t S = unit.numel / 2;
      EXPECT_EQ(e.name, unit.name);
      EXPECT_EQ(e.shards.dp.numel, unit.numel);
      EXPECT_EQ(e.shards.dp.shard, S);
      EXPECT_EQ(e.shards.dp.offset, S);
      const auto expect = [&](const UnitBlock& b, bool sharded, Tier home, const char* what) {
        EXPECT_TRUE(b.exists) << what;
        EXPECT_EQ(b.lo, sharded ? S : 0) << what << " stage " << stage;
        EXPECT_EQ(b.n, sharded ? S : unit.numel) << what << " stage " << stage;
        EXPECT_EQ(b.home, home) << what;
      };
      expect(e.params, stage >= 3, Tier::host, "params");
      expect(e.master, stage >= 1, Tier::device, "master");
      expect(e.adam, stage >= 1, Tier::device, "adam");
      expect(e.grads, stage >= 2, Tier::nvme, "grads");
      EXPECT_EQ(e.gathers_after_update(), stage == 1 || stage == 2);
      const AdamLayout al = e.adam_layout();
      EXPECT_EQ(al.m_offset(), 0);
      EXPECT_EQ(al.v_offset(), e.master.n);
      EXPECT_EQ(al.length(), 2 * e.master.n);
      EXPECT_EQ(t.bytes(Role::params, u), static_cast<uint64_t>(e.params.n) * 2);
      EXPECT_EQ(t.bytes(Role::adam, u), static_cast<uint64_t>(e.master.n) * 8);
      EXPECT_EQ(t.bytes(Role::grads, u), static_cast<uint64_t>(e.grads.n) * 4);
      EXPECT_THROW(e.block(Role::activations), std::logic_error);
    }
  }
}

// One fp32 block is master and weights only where it can be: fp32, one tier, a whole master.
TEST(ZeroUnitTable, MasterIsTheWeightsOnlyWhenWholeFp32AndOnTheirTier) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  Transformer f32(tiny_llama(), DType::f32, 1, 8, *rt, {}, kLogitsChunkBytes, 2);
  Transformer bf16(tiny_llama(), DType::bf16, 1, 8, *rt, {}, kLogitsChunkBytes, 2);
  Placement pl;
  EXPECT_TRUE(UnitTable(f32, pl).master_is_weights());
  EXPECT_TRUE(UnitTable(f32, pl)[0].master_is_weights);
  EXPECT_FALSE(UnitTable(bf16, pl).master_is_weights());
  pl.sharding = {1, 2, 0};
  EXPECT_FALSE(UnitTable(f32, pl).master_is_weights());
  pl.sharding = {1, 1, 0};  // one rank shards nothing
  EXPECT_TRUE(UnitTable(f32, pl).master_is_weights());
  pl.optimizer = Tier::host;
  EXPECT_FALSE(UnitTable(f32, pl).master_is_weights());
}

// A frozen unit keeps its working weights and nothing an update needs.
TEST(ZeroUnitTable, FrozenUnitHasOnlyWorkingWeights) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  Transformer model(tiny_llama(), DType::f32, 1, 8, *rt);
  std::vector<bool> trainable(model.units().size(), true);
  trainable[1] = false;
  const UnitTable t(model, Placement{}, trainable);
  EXPECT_TRUE(t[0].trainable);
  EXPECT_TRUE(t[0].grads.exists);
  const UnitEntry& e = t[1];
  EXPECT_FALSE(e.trainable);
  EXPECT_TRUE(e.params.exists);
  EXPECT_FALSE(e.master.exists || e.adam.exists || e.grads.exists || e.master_is_weights);
  EXPECT_FALSE(e.gathers_after_update());
  EXPECT_EQ(t.bytes(Role::master, 1) + t.bytes(Role::adam, 1) + t.bytes(Role::grads, 1), 0u);
  EXPECT_THROW(UnitTable(model, Placement{}, {true}), std::logic_error);
}

// The tiered memory homes exactly the table's blocks: per tier and role, the bytes add up.
TEST(ZeroUnitTable, TieredMemoryHomesTheTablesBlocks) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  Transformer model(tiny_llama(), DType::bf16, 1, 8, *rt, {}, kLogitsChunkBytes, 2);
  Placement pl;
  pl.params = Tier::host, pl.grads = Tier::host;
  pl.sharding = {2, 2, 0};
  const UnitTable t(model, pl);
  const MemoryPlan mp = TieredMemory::plan(model, kernels::Backend::cpu, pl, 1, 0);
  for (Role r : {Role::params, Role::master, Role::adam, Role::grads}) {
    uint64_t sum = 0;
    for (int u = 0; u < static_cast<int>(t.size()); ++u) sum += offload::align_up(t.bytes(r, u));
    const Tier home = t[0].block(r).home;
    EXPECT_EQ(mp.homed[offload::index(home)][static_cast<size_t>(r)], sum) << "role " << static_cast<int>(r);
  }
}

// The previous step's update rides in the first forward, or (nothing waits for the norm and
// the grads are whole) this step's in the last backward: never both, never elsewhere.
TEST(ZeroStepProgram, UpdatesRunInTheFirstForwardOrTheLastBackward) {
  Placement pl;
  const StepProgram pending(3, pl);
  EXPECT_TRUE(pending.update_pending());
  ASSERT_EQ(pending.size(), 3u);
  int64_t k = 0;
  for (const MicroBatch& mb : pending) {
    EXPECT_EQ(mb.index, k);
    EXPECT_EQ(mb.first, k == 0);
    EXPECT_EQ(mb.last, k == 2);
    EXPECT_EQ(mb.pending_update, k == 0);
    EXPECT_FALSE(mb.update_in_backward);
    ++k;
  }
  pl.norm_free = true;
  const StepProgram in_backward(2, pl);
  EXPECT_FALSE(in_backward.update_pending());
  for (const MicroBatch& mb : in_backward) {
    EXPECT_FALSE(mb.pending_update);
    EXPECT_EQ(mb.update_in_backward, mb.last);
  }
  pl.sharding = {2, 2, 0};  // reduce-scattered grads: the update waits for the next forward
  const StepProgram sharded(1, pl);
  EXPECT_TRUE(sharded.update_pending());
  EXPECT_TRUE(sharded.begin()->pending_update && sharded.begin()->first && sharded.begin()->last);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// Each transition checks the unit's state: a call out of order names the unit and its states.
TEST(ZeroUnitLifecycle, ACallOutOfOrderNamesTheUnitAndItsStates) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  Transformer model(tiny_llama(), DType::f32, 1, 8, *rt);
  FlatMemory mem(model, *rt);
  const auto message = [](const auto& fn) {
    try {
      fn();
    } catch (const std::logic_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  UnitLifecycle lc(model, mem, nullptr);
  lc.begin_pass({.backward = true, .first = true});
  EXPECT_EQ(message([&] { lc.drop_weights(1); }),
            "UnitLifecycle: drop_weights of unit block.0 out of order (weights resting, grads idle)");
  EXPECT_EQ(message([&] { lc.close_grads(1); }),
            "UnitLifecycle: close_grads of unit block.0 out of order (weights resting, grads idle)");
  lc.use_weights(1);
  EXPECT_EQ(message([&] { lc.use_weights(1); }),
            "UnitLifecycle: use_weights of unit block.0 out of order (weights in_use, grads idle)");
  lc.open_grads(1);
  EXPECT_EQ(message([&] { lc.finish_grads(1); }),
            "UnitLifecycle: finish_grads of unit block.0 out of order (weights in_use, grads writing)");
  EXPECT_EQ(message([&] { lc.end_pass(); }),
            "UnitLifecycle: end_pass of unit block.0 out of order (weights in_use, grads writing)");
  lc.close_grads(1);
  lc.drop_weights(1);
  lc.finish_grads(1);
  EXPECT_EQ(message([&] { lc.end_pass(); }), "no error");
  mem.s().synchronize();
}

}  // namespace
}  // namespace strata
