// The performance model of DESIGN.md: the step's compute (the model's own phases timed on a
// one-block copy), the optimizer's work, the bytes the plan moves per link — each over its
// measured rate is a floor, and the step can be no faster than the largest. Short probes
// measure the rates on this machine (`strata plan`). A step's FLOPs (6·params·tokens, causal
// attention, the recompute of checkpointed blocks) are reported beside them.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "io/swap_space.h"
#include "kernels/runtime.h"
#include "src/model/transformer.h"

namespace strata {

// Training FLOPs of one micro-batch of (batch, seq): forward 2 and backward 4 per matmul
// parameter per token, causal attention's q·kᵀ and p·v (lower triangle), plus one more
// forward for every checkpointed block.
double step_flops(const Transformer& model);
// The same for a config without building a model (benches): no recompute.
double step_flops(const ModelConfig& c, int64_t n_params, int64_t batch, int64_t seq);

// AdamW throughput (parameters/s) of the runtime's kernel over n fp32 parameters with a working
// copy in dt (what the optimizer phase runs unit by unit).
double probe_adamw_params_per_s(kernels::Runtime& rt, DType dt, int64_t n, double seconds);

// Compute and the disk beside each other, each one's speed relative to its speed alone (in
// (0, 1]). On the CPU backend the I/O's own CPU work (checksums, completions, the kernel's block
// layer) and the GEMMs share the cores: on the 2-vCPU VM the 1.5B all-NVMe step computes for
// 5.8-6.0 s where its phases probed alone add up to 5.2 s. A GEMM at the model's MLP shape (rows
// × hidden × intermediate, in dt) is timed alone, then beside io::BackgroundTraffic on `space`
// (16 pieces of piece_bytes, the run's checksums and O_DIRECT) in three rounds, each after the
// traffic alone, then alone again: about 1.1 × `seconds` in all. Throws the traffic's IoError.
struct Interference {
  double compute = 1;  // compute's speed while the disk moves bytes
  double disk = 1;     // the disk's while compute runs
};
Interference probe_interference(kernels::Runtime& rt, DType dt, const ModelConfig& cfg, int64_t rows,
                                io::SwapSpace& space, uint64_t piece_bytes, double seconds);

// The model's own phases, timed on a one-block copy of it (same widths, vocab, batch shape and
// dtype; random weights and tokens) for about `seconds` in all: what a step's compute costs on
// this runtime, with the ops GEMM FLOPs leave out (attention, norms, cross-entropy, casts) and
// the GEMMs at the model's own shapes.
struct PhaseTimes {
  double block_forward_ms = 0;   // one block's forward (a checkpointed block runs it twice)
  double block_backward_ms = 0;  // one block's backward, its forward not recomputed
  double edge_ms = 0;            // embedding forward + backward and the head (fwd + bwd) of a micro-batch
  double sum_squares_ms = 0;       // Σg² over one block's gradients (once per step)
  double edge_sum_squares_ms = 0;  // ... over the embedding's, final norm's and untied head's
};
// What the phases are probed on: the model's one-block copy at the run's micro-batch, or, where
// one micro-batch of that is too much work for a probe of seconds (an 8B llama's head alone is
// 1.6 TFLOP at 512 tokens), a scaled copy: fewer vocabulary rows for the embedding and head, a
// smaller batch, shorter rows, a narrower block (head_dim kept), in that order. A scaled probe's
// times are extrapolated to the model's shape phase by phase, each by its FLOPs (the head by
// N·C·V, Σg² by the unit's elements): it assumes the rates a smaller GEMM reaches.
struct ProbeShape {
  int64_t batch = 0, seq = 0;  // the probe's micro-batch
  int64_t width_div = 1;       // hidden, heads, kv heads and MLP width divided by this
  int64_t vocab = 0;           // rows of the probe's embedding and head
  double gflop = 0;            // one micro-batch of the probe: block and head, forward and backward
  double model_gflop = 0;      // the same at the model's shape
  bool scaled() const { return gflop < model_gflop; }
};
// The probe for cfg at (batch, seq): the model's shape when its micro-batch is at most
// max_gflop, else scaled until it is (or nothing more can shrink).
// tp: shapes of one tensor-parallel rank's part (its heads, MLP slice and vocabulary rows).
ProbeShape choose_probe_shape(const ModelConfig& cfg, int64_t batch, int64_t seq, double max_gflop, int tp = 1);
// lora: the run's adapters (a frozen base computes no weight gradients). shape: from
// choose_probe_shape for the same cfg, batch and seq (default: the model's own shape).
// tp > 1: one tensor-parallel rank's part (sequence: with sequence parallelism), its group's
// collectives not run (their bytes: tp_comm_bytes_per_step; their time is the group's link's).
PhaseTimes probe_phases(const ModelConfig& cfg, DType dt, int64_t batch, int64_t seq, kernels::Runtime& rt,
                        double seconds, const LoraSpec& lora = {}, const ProbeShape* shape = nullptr, int tp = 1,
                        bool sequence = false);
// The phases on a GPU that is not here (`strata plan --gpu`): each phase's FLOPs (those the
// scaled probe extrapolates by) at flops_per_s, the Σg² passes reading fp32 grads at
// mem_bytes_per_s (0: not counted).
PhaseTimes model_phases(const Transformer& model, double flops_per_s, double mem_bytes_per_s);
// The FLOPs of each phase PhaseTimes times, at the model's shape (those a scaled probe is
// extrapolated by, and a modeled GPU's phases are): one block's forward (matmuls and causal
// attention), its backward (input and weight gradients; a frozen block's input gradients only),
// and the head's forward and backward (the embedding's gather and scatter are memory-bound and
// not counted). Achieved rate per phase = these over PhaseTimes.
struct PhaseFlops {
  double block_forward = 0, block_backward = 0, edge = 0;
};
PhaseFlops phase_flops(const Transformer& model);
// A step's compute from the phases: per micro-batch the edges plus every block's forward and
// backward (checkpointed blocks' forward twice), times the micro-batches, plus the Σg² pass.
double step_compute_ms(const PhaseTimes& t, const Transformer& model, int grad_accum);
// Pipeline parallel: the step's compute through stages of `layers` in the 1F1B schedule. Stage
// s's micro-batch takes its layers' forward (twice where recomputed) and backward, the last
// stage's the head's too (the edges); the slowest stage runs its m micro-batches and every other
// stage adds one for the fill and drain: (m − 1)·max + Σ (Megatron's (m + p − 1)·t for equal
// stages), plus the slowest stage's Σ g². The point-to-point sends are not in it.
double pipeline_compute_ms(const PhaseTimes& t, const Checkpointing& ckpt, const std::vector<int64_t>& layers,
                           int grad_accum);
// The split of L layers over `stages` (each at least one) with the least pipeline_compute_ms:
// the slowest stage's micro-batch as short as it can be (the sum over stages is the same for
// every split), and among those the most even. The last stage carries the head, so where the
// head is costly it takes fewer layers (gpt2-124m over 2 stages: 9,3).
std::vector<int64_t> balanced_pipeline_layers(const PhaseTimes& t, const Checkpointing& ckpt, int64_t L, int stages);
// The layers of each of `stages` pipeline stages (--pp): `given` (--pp-layers) when set, else the
// split balanced by FLOPs a micro-batch (balanced_pipeline_layers over each layer's forward,
// recompute and backward and the head's 3 × its logits matmul on the last stage): the same split
// on every rank and in every plan, from the config alone. Throws naming the numbers where the
// stages cannot each get a layer.
std::vector<int64_t> pipeline_split(const ModelConfig& cfg, int64_t batch, int64_t seq, const TensorParallel& tp,
                                    const Checkpointing& ckpt, int stages, const std::string& given);

struct StepFloor {
  double compute_ms = 0;  // the model's phases as probed (step_compute_ms)
  double adamw_ms = 0;    // parameters / AdamW rate
  std::array<double, 4> link_ms{};  // per offload::Link: bytes / bandwidth (0 when not measured)
  double nvme_ms = 0;     // reads + writes share the disk
  double predicted_ms = 0;
};

}  // namespace strata
