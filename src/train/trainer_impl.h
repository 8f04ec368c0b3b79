// Trainer::Impl: the state of a run, shared by the files that make up the trainer, one concern
// each: trainer.cpp (set-up, one step, validation), run_loop.cpp (the run: steps, checkpoints
// on schedule and on signals, summary, save), run_setup.cpp (options into a resolved run:
// model, data, precision, placement; `strata plan`), train_state.cpp (state in and out: init,
// save, checkpoint, restore), report.cpp (header, progress lines, --metrics) and
// batch_source.cpp (where the rows come from).
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "kernels/runtime.h"
#include "src/comm/communicator.h"
#include "src/comm/grid.h"
#include "src/model/transformer.h"
#include "src/optim/adamw.h"
#include "src/optim/schedule.h"
#include "src/train/batch_source.h"
#include "src/train/report.h"
#include "src/train/run_guard.h"
#include "src/train/speculation_trial.h"
#include "src/train/step_driver.h"
#include "src/train/tiered_memory.h"
#include "src/train/trainer.h"

namespace strata {

struct Trainer::Impl {
  TrainOptions o;
  ModelConfig cfg;
  std::string model_source;  // for the header
  std::string data_source;   // ... and what the rows are made of
  DType dtype = DType::f32;
  kernels::Backend backend = kernels::Backend::cpu;
  Placement placement;
  std::unique_ptr<Communicator> comm;  // the job's ranks (local: one rank, no MPI)
  std::unique_ptr<ProcessGroups> groups;  // the (dp, pp, tp) grid of comm's ranks (--tp, --pp)
  // Pipeline parallel with a tied head: the first and last stage of this rank's (dp, tp)
  // position, which hold the embedding's two copies (null elsewhere).
  std::unique_ptr<Communicator> embed_group;
  std::vector<int64_t> pp_layers;  // --pp: each stage's layers
  Sharding sh;                         // this rank's part of every unit over the data-parallel group (ZeRO stage)
  std::unique_ptr<kernels::Runtime> rt;
  std::unique_ptr<kernels::Stream> stream;
  std::unique_ptr<kernels::Stream> comm_stream;  // world > 1: the collectives of a step
  std::unique_ptr<kernels::Runtime> cpu_rt;      // CUDA runs with the optimizer on the CPU
  std::unique_ptr<kernels::Stream> cpu_stream;
  std::unique_ptr<Transformer> model;
  std::unique_ptr<TieredMemory> mem;
  std::unique_ptr<StepDriver> driver;
  AdamWConfig adamw;
  LossScaler scaler{false};
  LrScheduleConfig sched;
  std::unique_ptr<BatchSource> data;  // the training rows
  std::unique_ptr<BatchSource> val;   // --val-data (null: no validation)
  // Per micro-batch: inputs, targets, then with documents positions and segment starts (N each).
  int64_t arrays = 2;
  std::vector<int32_t> host_tokens;   // (accum, arrays, N)
  std::vector<float> host_losses;     // (accum, N)
  std::vector<double> host_norm2;     // (units) Σ g² per unit
  int32_t* dev_tokens = nullptr;      // same layout as host_tokens, in the step buffers
  int64_t trained_done = 0;           // trained targets so far (all ranks)
  double* dev_norm2 = nullptr;        // (units)
  MetricsFile metrics;                // --metrics (rank 0)
  int64_t steps_done = 0;
  int64_t tokens_done = 0;
  int64_t skipped_steps = 0;          // fp16 overflows: AdamW's step count does not advance
  double startup_s = 0;
  double weights_s = 0;  // of startup_s: initialising or loading the weights into their tiers
  offload::OffloadStats last_stats;   // cumulative, at the end of the previous step
  double last_stall = 0;
  // The last step's optimizer step, carried out inside the next step's forward (or by flush()).
  std::optional<PendingUpdate> pending;
  // --speculate auto backs off after a rollback: the next `plain_left` steps wait for the norm
  // (TieredMemory::Schedule::plain), `backoff` of them after the next rollback (doubling while
  // speculation keeps failing, back to 1 once a speculative update stands).
  int64_t plain_left = 0, backoff = 1;
  // --speculate auto with --speculate-trial N: the first steps time both ways, then the run
  // keeps the faster (null: no trial; speculating from the start).
  std::optional<SpeculationTrial> trial;
  int64_t trial_again = 0;  // after a verdict to wait: the step count from which a trial runs again
  int64_t trial_interval = 0;  // steps from a verdict to wait to the next trial (0: none to wait since)
  bool speculating() const {
    if (!placement.speculate) return false;
    if (trial && trial->deciding()) return trial->speculate_next();
    return (!trial || trial->verdict()) && plain_left == 0;
  }
  std::filesystem::path resumed_from;  // the checkpoint this run continued (empty: a fresh start)
  std::string run_id;                  // this run's identity (trainer.json): rotation removes only its own
  PathLock checkpoint_lock, out_lock;  // rank 0: held for the life of the run (run_guard.h)
  std::vector<std::string> resume_changes;  // flags that differ from the checkpoint's run
  int64_t last_checkpoint_step = -1;
  uint32_t base_crc = 0;  // LoRA: crc32c of the frozen base's fp32 values as loaded (trainer.json)

  int64_t N() const { return o.batch * o.seq; }
  // The job's rank 0 (it alone prints and writes); tensor parallelism's group and place.
  bool rank0() const { return comm->rank() == 0; }
  const TensorParallel& tp() const { return model->tensor_parallel(); }
  const PipelineStage& pp() const { return model->pipeline(); }
  // Saves gather every tensor whole to rank 0 first (from the ZeRO shards, the tp parts, the
  // pipeline stages); else each streams from its block.
  bool saves_gathered() const { return sh.sharded_optimizer() || tp().on() || pp().on(); }
  kernels::Stream& opt_stream() { return cpu_stream ? *cpu_stream : *stream; }
  double busy_ms() const { return stream->busy_ms() + (cpu_stream ? cpu_stream->busy_ms() : 0); }
  // Communication: all the comm stream ran (collectives, and the sums and copies that finish a
  // reduce-scatter) plus collectives run on other streams.
  double comm_ms() const {
    const double on_comm = comm_stream ? comm_stream->busy_ms() : 0;
    return on_comm + comm->busy_ms() - (comm_stream ? comm->busy_ms(comm_stream.get()) : 0);
  }
  // Communication compute waited for: collectives run on the compute stream itself (outside
  // steps) plus the driver's waits for the comm stream's.
  double exposed_ms() const { return comm->busy_ms(stream.get()) + (driver ? driver->exposed_ms() : 0); }

  // train_state.cpp
  // base_weights (LoRA): the frozen base comes from --model's safetensors, else a random init.
  void init_weights(bool load_weights, bool base_weights);
  void flush();
  // The whole of unit u's `role` block from every rank's shard (elements [offset, offset + S)
  // of each rank's block, S = the shard size), in rank order. Collective: every rank calls it in
  // the same order; rank 0 gets numel elements, the others an empty vector.
  std::vector<float> gather_unit(Role role, int u, int64_t offset);
  // Elements [e0, e1) of that whole into dst on rank 0 (null elsewhere): each rank sends the
  // part its shard holds. Collective over the data-parallel ranks, in the same order on each.
  void gather_range(Role role, int u, int64_t offset, int64_t e0, int64_t e1, float* dst);
  // Every trainable tensor's whole HF values of a role's block, a piece or a unit at a time, on
  // the job's rank 0, for a sharded, tensor-parallel or pipelined save (train_state.cpp).
  class TensorStream;
  // A save's TensorToSave::fill_range for part k of parameter pi, from a stream made for pieces,
  // non-finite values refused (`what`).
  static std::function<void(void*, uint64_t, uint64_t)> streamed(TensorStream* s, size_t pi, size_t k, std::string what);
  // Every trainable tensor's whole HF values (by parameter index) of `role`, from element
  // offset(u) of each unit's block, kept on the job's rank 0 (empty elsewhere): a TensorStream
  // collected whole, for --merge-adapter's save. Collective: every rank calls it.
  std::vector<std::vector<float>> gather_tensors(Role role, const std::function<int64_t(int)>& offset);
  // Parameter p's whole HF tensor from every tp rank's part of it (unit_part: this rank's unit,
  // as laid out), on tp rank 0 (empty elsewhere; collective over the group). Without tensor
  // parallelism, p's values.
  std::vector<float> whole_tensor(const ParamInfo& p, const float* unit_part) const;
  nlohmann::json state_json() const;
  // lora_state.cpp: PEFT's adapter_config.json; --merge-adapter's save (rank 0). tensors: a
  // sharded or tensor-parallel run's whole tensors by parameter index (the adapters from
  // gather_tensors; under tensor parallelism the base too, from gather_base); null: the adapters
  // from their blocks, the base loaded or initialised a unit at a time.
  nlohmann::json peft_config() const;
  void save_merged(const std::string& out_dir, const std::vector<std::vector<float>>* tensors);
  // Tensor parallel, --merge-adapter: the frozen base's whole tensors into table (by parameter
  // index) on rank 0, from each rank's part as loaded or initialised. Collective.
  void gather_base(std::vector<std::vector<float>>& table);
  bool base_weights = false;  // LoRA: the frozen base is --model's safetensors (else a random init)
  void restore_state(const nlohmann::json& manifest);
};

}  // namespace strata
