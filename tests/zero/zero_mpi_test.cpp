// The unit lifecycle across real ranks (CTest runs it as `mpirun -n 2`), at each ZeRO stage,
// driven unit by unit without the model's compute: a unit's weights gathered whole from every
// rank's shard (stage 3), its gradients summed across ranks into the grads block (all-reduce at
// stages 0-1, reduce-scatter of this rank's shard at 2-3) with this rank's Σ g², and its AdamW
// update, after which the next pass sees the new weights — every stage bitwise stage 0's, and
// stage 0's update as AdamW's first step computes it on the host.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/runtime.h"
#include "src/comm/communicator.h"
#include "tests/comm/mpi_check.h"
#include "src/model/transformer.h"
#include "src/train/tiered_memory.h"
#include "src/zero/unit_lifecycle.h"
#include "src/zero/unit_table.h"

using namespace strata;
using offload::Mode;

namespace {

// Exact in fp32, so sums over ranks are exact whatever their order.
float master0(int u, int64_t i) { return static_cast<float>((u * 31 + i * 13) % 23 - 11) * 0.01f; }
float grad(int u, int64_t i, int rank) { return static_cast<float>((u * 131 + i * 7) % 17 - 8) * 0.25f * (rank + 1); }

ModelConfig tiny_llama() {
  ModelConfig c = default_model_config();
  c.hidden_size = 32, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 8;
  c.intermediate_size = 64, c.max_position_embeddings = 64, c.tie_word_embeddings = false;
  return c;
}

struct StageRun {
  std::vector<std::vector<float>> after;  // [unit] the whole working weights after the update
};

StageRun run_stage(Communicator& comm, int stage) {
  const int rank = comm.rank(), world = comm.world();
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  auto compute = rt->create_stream(), comm_stream = rt->create_stream();
  Transformer model(tiny_llama(), DType::f32, 1, 8, *rt, {}, kLogitsChunkBytes, world);
  Placement pl;
  pl.sharding = Sharding{stage, world, rank};
  TieredMemory mem(model, *rt, *compute, *rt, *compute, pl, 1, 64, comm_stream.get());
  const UnitTable& t = mem.units();
  const int n_units = static_cast<int>(t.size());
  const std::string where = "stage " + std::to_string(stage) + " rank " + std::to_string(rank);

  // This rank's master (and working weights, unless they are one block) from master0.
  mem.begin_step(TieredMemory::Schedule::aside);
  for (int u = 0; u < n_units; ++u) {
    const UnitEntry& e = t[u];
    auto* m = static_cast<float*>(mem.acquire(Role::master, u, Mode::write, Side::host));
    for (int64_t i = 0; i < e.master.n; ++i) m[i] = e.master.lo + i < e.n_real ? master0(u, e.master.lo + i) : 0.f;
    mem.release(Role::master, u);
    if (!mem.master_is_weights()) {
      auto* w = static_cast<float*>(mem.acquire(Role::params, u, Mode::write, Side::host));
      for (int64_t i = 0; i < e.params.n; ++i) w[i] = e.params.lo + i < e.n_real ? master0(u, e.params.lo + i) : 0.f;
      mem.release(Role::params, u);
    }
    auto* a = static_cast<float*>(mem.acquire(Role::adam, u, Mode::write, Side::host));
    std::memset(a, 0, static_cast<size_t>(e.adam_layout().length()) * 4);
    mem.release(Role::adam, u);
  }
  mem.end_step();

  UnitLifecycle lc(model, mem, &comm);
  // The weights a pass sees, whole (gathered at stage 3), unit by unit in the forward's order.
  const auto see_weights = [&](std::vector<std::vector<float>>* out) {
    for (int u = 0; u < n_units; ++u) {
      const auto* w = static_cast<const float*>(lc.use_weights(u));
      compute->synchronize();
      if (out) out->emplace_back(w, w + t[u].n_real);
      lc.drop_weights(u);
    }
  };

  // Pass 1: the weights as initialised, then every unit's gradient.
  std::vector<double> norm2(static_cast<size_t>(n_units), 0.0);
  mem.begin_step(TieredMemory::Schedule::aside);
  lc.begin_pass({.backward = true, .first = true, .last = true, .norm2 = norm2.data()});
  std::vector<std::vector<float>> seen;
  see_weights(&seen);
  for (int u = 0; u < n_units; ++u)
    for (int64_t i = 0; i < t[u].n_real; ++i)
      CHECK(seen[static_cast<size_t>(u)][static_cast<size_t>(i)] == master0(u, i),
            where + ": unit " + t[u].name + " element " + std::to_string(i) + " is not the whole unit's weight");
  for (int64_t l = model.dims().L - 1; l >= 0; --l) {  // the backward's uses (stage 3: gathered again)
    lc.use_weights(model.block_unit(l));
    lc.drop_weights(model.block_unit(l));
  }
  for (int u = n_units - 1; u >= 0; --u) {
    float* g = lc.open_grads(u);
    compute->synchronize();  // the slot is free (the previous reduce-scatter read it)
    for (int64_t i = 0; i < t[u].numel; ++i) g[i] = i < t[u].n_real ? grad(u, i, rank) : 0.f;
    lc.close_grads(u);
    lc.finish_grads(u);
  }
  lc.end_pass();
  mem.end_step();
  compute->synchronize();
  comm_stream->synchronize();

  // Each rank's grads block: the sum over ranks of its elements; Σ over ranks of each rank's
  // Σ g² is the whole unit's.
  mem.begin_step(TieredMemory::Schedule::aside);
  for (int u = 0; u < n_units; ++u) {
    const UnitEntry& e = t[u];
    const auto* g = static_cast<const float*>(mem.acquire(Role::grads, u, Mode::read, Side::host));
    double want2 = 0;
    for (int64_t i = 0; i < e.grads.n; ++i) {
      const int64_t at = e.grads.lo + i;
      float sum = 0;
      for (int r = 0; r < world; ++r) sum += at < e.n_real ? grad(u, at, r) : 0.f;
      CHECK(g[i] == sum, where + ": unit " + e.name + " grad " + std::to_string(at) + " is " + std::to_string(g[i]) +
                             ", the sum over ranks " + std::to_string(sum));
    }
    for (int64_t i = 0; i < e.n_real; ++i) {
      float sum = 0;
      for (int r = 0; r < world; ++r) sum += grad(u, i, r);
      want2 += static_cast<double>(sum) * sum;
    }
    // Every rank's Σ g² (a double moved as two fp32 words: all_gather only copies).
    std::vector<double> each(static_cast<size_t>(world));
    comm.all_gather(&norm2[static_cast<size_t>(u)], each.data(), 2, DType::f32, *compute);
    compute->synchronize();
    double got2 = 0;
    for (double v : each) got2 += v;
    CHECK(std::abs(got2 - want2) <= 1e-9 * want2, where + ": unit " + e.name + " Σ g² " + std::to_string(got2) +
                                                       " across ranks, want " + std::to_string(want2));
    mem.release(Role::grads, u);
  }
  mem.end_step();

  // The update, then a forward pass sees the new weights everywhere.
  AdamWStep st;
  st.lr = 1e-2f;
  mem.begin_step(TieredMemory::Schedule::aside);
  lc.optimizer(st, true);  // (ends its own pass)
  mem.end_step();
  compute->synchronize();
  comm_stream->synchronize();
  StageRun out;
  mem.begin_step(TieredMemory::Schedule::aside);
  lc.begin_pass({});
  see_weights(&out.after);
  lc.end_pass();
  mem.end_step();
  compute->synchronize();
  comm_stream->synchronize();
  return out;
}

}  // namespace

int main() {
  try {
    auto comm = make_communicator();
    const int rank = comm->rank();
    CHECK(comm->world() >= 2, "run under mpirun -n 2 (or more)");
    const StageRun ref = run_stage(*comm, 0);
    // Stage 0 against AdamW's first step on the host (m̂ = g, v̂ = g², decay on 2-D tensors).
    {
      auto rt = kernels::make_runtime(kernels::Backend::cpu);
      Transformer model(tiny_llama(), DType::f32, 1, 8, *rt, {}, kLogitsChunkBytes, comm->world());
      const AdamWConfig c;
      for (const ParamInfo& p : model.params())
        for (int64_t i = 0; i < p.numel; ++i) {
          const int u = p.unit;
          const int64_t at = p.unit_offset + i;
          double g = 0;
          for (int r = 0; r < comm->world(); ++r) g += grad(u, at, r);
          const double w = master0(u, at);
          const double want = w - 1e-2 * (g / (std::abs(g) + c.eps) + (p.decay ? c.weight_decay * w : 0.0));
          const double got = ref.after[static_cast<size_t>(u)][static_cast<size_t>(at)];
          CHECK(std::abs(got - want) <= 1e-6, p.name + " element " + std::to_string(i) + ": " + std::to_string(got) +
                                                  " after the update, AdamW's first step gives " + std::to_string(want));
        }
    }
    for (int stage = 1; stage <= 3; ++stage) {
      const StageRun got = run_stage(*comm, stage);
      for (size_t u = 0; u < ref.after.size(); ++u)
        CHECK(got.after[u] == ref.after[u], "stage " + std::to_string(stage) + ": unit " + std::to_string(u) +
                                                "'s updated weights differ from stage 0's");
    }
    if (rank == 0) std::printf("zero_mpi_test: stages 0-3 gather, reduce and update as stage 0 and AdamW do\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero_mpi_test: %s\n", e.what());
    return 1;
  }
}
