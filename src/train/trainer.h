// The training loop of `strata train` (and `strata bench step`): resolves the model (HF
// directory, preset or the embedded default), data (token shards or the embedded corpus),
// precision and optimizer from TrainOptions, allocates everything once, then runs optimizer
// steps: micro-batches with gradient accumulation, global-norm clipping, AdamW, LR schedule.
#pragma once
#include <cstdint>
#include <cstdio>
#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "src/model/config.h"
#include "src/train/options.h"
#include "src/train/tiered_memory.h"

namespace strata {

// What one optimizer step did (also one line of --metrics).
struct StepStats {
  int64_t step = 0;          // 1-based
  double loss = 0;           // mean cross-entropy over the global batch's trained targets
  int64_t trained_tokens = 0;  // the global batch's trained targets (0: nothing to train, skipped)
  double grad_norm = 0;      // global L2 norm before clipping (NaN/Inf when fp16 overflowed)
  double lr = 0;
  int64_t tokens = 0;        // tokens processed so far (cumulative, all steps up to this one)
  double step_ms = 0;
  double tokens_per_s = 0;
  bool skipped = false;      // fp16 overflow (loss scale halved) or no trained target: no update
  bool diverged = false;     // loss (or, outside fp16, grad norm) not finite: nothing applied
  double loss_scale = 1;
  // --speculate: this step's update ran in the backward with clip coefficient 1; rolled_back:
  // the norm clipped (or fp16 overflowed, or the step diverged), so the step was rerun from the
  // previous state and its true update (or none) left for the next step.
  bool speculated = false;
  bool rolled_back = false;
  // --speculate auto: the step that ended its trial (SpeculationTrial) carries the verdict and
  // each way's mean step time on this rank (rank 0's verdict holds for every rank).
  struct TrialVerdict {
    bool speculate = false;
    double speculating_ms = 0, waiting_ms = 0;
  };
  std::optional<TrialVerdict> speculation_trial;
  // Offload: bytes moved per link during this step, time compute waited for blocks, and
  // the time each link was busy.
  std::array<uint64_t, 4> link_bytes{};   // h2d, d2h, host_to_nvme, nvme_to_host
  std::array<double, 4> link_ms{};
  double nvme_busy_ms = 0;  // wall time with any NVMe read or write in flight (the disk's busy time)
  double checksum_ms = 0;   // time in the swap's checksums, summed over threads: the I/O's own CPU cost
  double stall_ms = 0;
  double compute_ms = 0;  // time the compute (and optimizer) streams spent running work
  uint64_t comm_bytes = 0;  // sent by this rank to the others this step (as many received)
  // Measured: time this rank's collectives ran in the step (moving and summing bytes, waiting
  // for the other ranks) on their own stream, and the time compute waited for them (exposed:
  // a gathered unit not there yet, a scratch slot still being reduce-scattered, the step's
  // last collectives). CPU backend; a CUDA run does not time its waits yet (0).
  double comm_ms = 0;
  double comm_exposed_ms = 0;
  // Tensor parallelism (--tp): sent by this rank over its tp group this step (the sub-layers'
  // all-reduces, the embedding's and the head's, the cross-entropy's statistics), measured;
  // and the time those collectives ran, on the compute stream (all of it exposed; not in
  // compute_ms).
  uint64_t tp_comm_bytes = 0;
  double tp_comm_ms = 0;
  // Pipeline parallelism (--pp): sent by this rank to its neighbour stages this step (each
  // micro-batch's activations forward and their gradients back) and, with a tied head, the
  // embedding's gradient summed between the first and last stage, measured; the time those ran
  // (the transfers on the comm stream, moving bytes and waiting for the neighbour; the sum on
  // compute); and the measured bubble: 1 − the ranks' mean busy time in the 1F1B schedule (its
  // span less compute's waits for transfers) over the longest schedule's span (ideally
  // (p−1)/(m+p−1)).
  uint64_t pp_comm_bytes = 0;
  double pp_comm_ms = 0;
  double pp_bubble = 0;
  uint64_t bytes_moved() const { return link_bytes[0] + link_bytes[1] + link_bytes[2] + link_bytes[3]; }
};

// What a run would hold and move, computed from its options without allocating the model:
// the per-tier budgets and homes, the bytes per link per step (`strata plan`). Throws the
// same errors a Trainer would (invalid flags, a budget that cannot fit).
struct RunPlan {
  ModelConfig cfg;
  LoraSpec lora;                // --lora-* (an --adapter's config applied)
  int64_t n_params = 0;
  int64_t tokens_per_step = 0;  // the global batch: all ranks
  int world = 1;
  bool update_in_backward = false;  // Placement::update_in_backward(): no norm barrier
  bool speculate = false;           // ... because the update is speculative (--speculate)
  MemoryPlan memory;            // per rank
  uint64_t comm_bytes = 0;      // sent per step by each rank over its data-parallel group (as many received)
  int tp = 1;                   // --tp: the tiers are tp rank 0's part
  uint64_t tp_comm_bytes = 0;   // sent per step by each rank over its tp group
  // --pp: the stages' layers; the tiers (memory) are those of stage `stage`, the one that holds
  // the most; each stage's own below. Sent per step by the rank that sends the most to its
  // neighbour stages (each micro-batch's activations forward and their gradients back, 2·B·T·h
  // per micro-batch per boundary, and a tied head's embedding gradient between the first and
  // last stage), and Megatron-LM's ideal bubble (p−1)/(m+p−1).
  int pp = 1;
  std::vector<int64_t> pp_layers;
  int stage = 0;
  std::vector<MemoryPlan> stage_memory;
  std::vector<int64_t> stage_params;  // trainable parameters per stage
  uint64_t pp_comm_bytes = 0;
  double pp_bubble = 0;
};
// world: plan one rank of a job of that many ranks (--zero-stage decides what is sharded over its
// data-parallel replicas, world / --tp).
RunPlan plan_run(const TrainOptions& opts, bool minimums = false, int world = 1);
// One rank's step time: the plan replayed with these costs under plan_run's budgets (`plan`,
// from plan_run with the same options; TieredMemory::estimate).
offload::StepTimeline estimate_run(const TrainOptions& opts, const RunPlan& plan, const StepCosts& costs);

// Bytes each rank sends (and receives) per optimizer step for the collectives of its ZeRO
// stage, as the mpi communicator moves them: an all-reduce of B bytes sends 2(N-1)/N·B
// (reduce-scatter, then all-gather), a reduce-scatter or an all-gather (N-1)/N·B. Stage 0/1:
// every unit's fp32 grads all-reduced once per step; 1/2: its working weights all-gathered
// after the update; 2: its fp32 grads reduce-scattered once per micro-batch.
uint64_t comm_bytes_per_step(const Transformer& model, const Sharding& sh, int64_t grad_accum);
// Bytes a tensor-parallel rank sends over its tp group per step (0 without tensor parallelism),
// by Communicator::sent_bytes' count: Megatron-LM's 4 all-reduces of the (B·T, hidden)
// activations per layer, 2 more per recomputed layer, the embedding's and the head's, the
// cross-entropy's 3 floats a row; with sequence parallelism the same as all-gathers and
// reduce-scatters, plus the norms' grads.
uint64_t tp_comm_bytes_per_step(const Transformer& model, int64_t grad_accum);
// Bytes a pipeline stage sends per step (0 without pipeline parallelism), by sent_bytes' count:
// each micro-batch's (res_rows, C) activations to the next stage and their gradients to the one
// before, and with a tied head the embedding's gradient all-reduced between the first and last
// stage (2·(2−1)/2 of it sent).
uint64_t pp_comm_bytes_per_step(const Transformer& model, int64_t grad_accum);

class Trainer {
 public:
  // Resolves and validates everything, allocates all buffers, initialises or loads the weights.
  // Invalid options (e.g. --seq beyond max_position_embeddings, unwritable --out) throw with
  // one clear line, before any training.
  explicit Trainer(const TrainOptions& opts);
  ~Trainer();

  // The mean masked loss over the held-out set (--val-data; --eval-batches micro-batches, or
  // all of it), forward only, with any pending update applied first. Changes nothing that
  // training computes. Collective (every rank calls it).
  struct EvalStats {
    double loss = 0;        // Σ CE over trained targets / their count
    int64_t tokens = 0;     // trained targets evaluated (all ranks)
    int64_t batches = 0;    // micro-batches per rank
    double ms = 0;
  };
  EvalStats evaluate();
  bool has_validation() const;
  // One optimizer step. A diverged step (StepStats::diverged) applies no update; run() then
  // stops with an error, and callers of step() should too.
  StepStats step();
  int run(std::FILE* out);           // the whole run: header, steps, metrics, summary, save
  void print_header(std::FILE* out) const;
  const ModelConfig& config() const;
  int64_t n_params() const;
  int64_t tokens_per_step() const;   // B·T·grad_accum·world (the global batch)
  int rank() const;                  // this process's rank in the job (0 without mpirun)
  int world() const;
  size_t device_bytes() const;       // device pool (CPU backend: RAM standing in for the device)
  size_t host_bytes() const;         // pinned host pool
  size_t nvme_bytes() const;         // swap space in use
  void save(const std::string& out_dir) const;
  // Writes a training checkpoint of the state after the last step under --checkpoint-dir.
  std::string save_checkpoint();
  int64_t steps_done() const;
  double matmul_gflops_probe(int64_t m, int64_t n, int64_t k, int reps);  // bare fp32 GEMM, for bench

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
