#!/usr/bin/env bash
# Issue 27's pipeline-bubble figure: `mpirun -np P strata train --pp P --grad-accum M` on the CPU
# backend, one thread per rank, for each P and M given, against Megatron-LM's (p−1)/(m+p−1).
# The model has equal stages (8 llama layers, a vocabulary of 256 so the head and embedding are
# a small part of the first and last stage). Measured: --metrics pp_bubble (1 − the ranks' mean
# busy time in the schedule over the longest schedule's span; a rank's busy time is its span less
# compute's waits for the point-to-point transfers), the mean of steps 2..N; step_ms, and what
# stage 0 sent per step (pp_comm_bytes_sent).
#   bench/pp_bubble.sh BIN [STEPS] [P:M ...]      (default 6 steps; 2:4 2:8 4:4 4:8)
# Needs P cores for P ranks to mean what it says: oversubscribed, a waiting rank's MPI polling
# takes the core a working rank needs (OpenMPI yields when oversubscribed, which softens it).
set -euo pipefail
bin=$1; steps=${2:-6}; shift $(( $# >= 2 ? 2 : 1 ))
cases=("$@"); [[ ${#cases[@]} -gt 0 ]] || cases=(2:4 2:8 4:4 4:8)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/model"
cat > "$dir/model/config.json" <<'JSON'
{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 512,
 "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 1376,
 "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
 "hidden_act": "silu"}
JSON
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
printf "%-4s %-4s %10s %10s %8s %10s %14s\n" p m ideal measured "off" step_ms stage0_bytes
for c in "${cases[@]}"; do
  p=${c%%:*} m=${c##*:}
  "$(command -v mpirun)" -np "$p" "$bin" train --model "$dir/model" --threads 1 --batch 1 --seq 128 --steps "$steps" \
    --grad-accum "$m" --pp "$p" --metrics "$dir/m.jsonl" >/dev/null
  awk -v p="$p" -v m="$m" '
    function num(k) { return match($0, "\"" k "\":[0-9.eE+-]+") ? substr($0, RSTART + length(k) + 3, RLENGTH - length(k) - 3) + 0 : 0 }
    NR > 1 { n++; b += num("pp_bubble"); ms += num("step_ms"); bytes = num("pp_comm_bytes_sent") }
    END { ideal = (p - 1) / (m + p - 1); b /= n; ms /= n
          printf "%-4d %-4d %9.1f%% %9.1f%% %+7.0f%% %10.1f %14d\n", p, m, 100 * ideal, 100 * b, 100 * (b - ideal) / ideal, ms, bytes }' "$dir/m.jsonl"
  rm -f "$dir/m.jsonl"
done
