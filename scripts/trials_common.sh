# Sourced by the trial scripts (kill_trials.sh, kill_trials_mpi.sh, share_trials.sh): a scratch
# folder removed at exit holding a tiny byte-level llama, and the bit-exact part of --metrics.

# trials_setup LAYERS: sets $work (removed at exit) and writes $work/tiny/config.json.
trials_setup() {
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/tiny"
  cat >"$work/tiny/config.json" <<JSON
{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
 "num_hidden_layers": $1, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
 "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
 "hidden_act": "silu"}
JSON
}

# exact METRICS: "step loss grad_norm" of each line, as printed (the shortest round-trip text).
exact() { grep -o '"step":[0-9]*\|"loss":[^,]*\|"grad_norm":[^,]*' "$1" | paste -d' ' - - -; }
