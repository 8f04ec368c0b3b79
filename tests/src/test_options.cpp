// The option table (src/train/options.h) and the test faults (src/train/faults.h).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <string>

#include "src/train/faults.h"
#include "src/train/options.h"

namespace strata {
namespace {

// A checkpoint's trainer.json records these flags by these keys, and a resume compares them: a
// key that changes or goes missing would report every resume of an older checkpoint as changed.
TEST(Options, ACheckpointRecordsTheSameFlagsUnderTheSameKeys) {
  const std::set<std::string> expected = {
      "model", "preset", "data", "pack", "shuffle", "epochs", "val_data", "eval_every", "eval_batches",
      "synthetic_data", "backend", "dtype", "batch", "seq", "grad_accum", "steps", "lr", "lr_schedule", "warmup",
      "min_lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip", "loss_scale", "seed", "offload_params",
      "offload_grads", "offload_optimizer", "offload_activations", "checkpoint_activations", "offload", "nvme_path",
      "device_mem", "host_mem", "zero_stage", "tp", "sequence_parallel", "pp", "pp_layers", "lora_rank", "lora_alpha", "lora_rslora", "lora_dropout",
      "lora_targets", "adapter", "base_dtype"};
  TrainOptions o;
  o.nvme_paths = {"/a", "/b"};
  o.seed = 18446744073709551615ull;
  const nlohmann::json j = options_json(o);
  std::set<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.insert(k);
  EXPECT_EQ(keys, expected);
  EXPECT_EQ(j["nvme_path"], nlohmann::json::array({"/a", "/b"}));
  EXPECT_EQ(j["seed"].get<uint64_t>(), 18446744073709551615ull);  // not wrapped to a signed number
  EXPECT_TRUE(j["grad_accum"].is_number_integer());
  EXPECT_TRUE(j["shuffle"].is_boolean());
}

// Every rank compares these values as typed; a rank's own cores and disks may differ.
TEST(Options, RanksAgreeOnEveryFlagButThreadsAndNvmePaths) {
  TrainOptions o;
  o.lr = 1e-3;
  o.shuffle = true;
  std::set<std::string> flags;
  for (const auto& [flag, value] : option_values(o)) {
    flags.insert(flag);
    if (flag == "--lr") {
      EXPECT_EQ(value, "0.001");
    } else if (flag == "--shuffle") {
      EXPECT_EQ(value, "true");
    } else if (flag == "--steps") {
      EXPECT_EQ(value, "100");
    }
  }
  EXPECT_EQ(flags.count("--threads"), 0u);
  EXPECT_EQ(flags.count("--nvme-path"), 0u);
  EXPECT_EQ(flags.count("--synthetic-data"), 0u);  // not a flag
  for (const char* f : {"--model", "--zero-stage", "--resume", "--keep", "--metrics", "--offload-optimizer"})
    EXPECT_EQ(flags.count(f), 1u) << f;
  std::set<std::string> all;
  for (const OptionSpec& spec : option_table()) EXPECT_TRUE(all.insert(spec.flag).second) << "twice: " << spec.flag;
}

TEST(Options, ValidationNamesTheFlag) {
  TrainOptions o;
  o.keep = 0;
  try {
    validate_options(o);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--keep"), std::string::npos) << e.what();
  }
  o = TrainOptions{};
  o.checkpoint_every = 5;
  EXPECT_THROW(validate_options(o), std::invalid_argument);  // no --checkpoint-dir
}

TEST(Faults, ParsesEachFaultAndRefusesWhatItDoesNotKnow) {
  const Faults none = parse_faults("");
  EXPECT_EQ(none.kill_rank, -1);
  EXPECT_TRUE(none.io.empty());
  EXPECT_FALSE(none.separate_optimizer);
  EXPECT_TRUE(none.trial_verdicts.empty());
  const Faults f = parse_faults("separate-optimizer,kill:1:3,io-flip:60,trial-verdicts:10");
  EXPECT_TRUE(f.separate_optimizer);
  EXPECT_TRUE(f.trial_verdict(0));
  EXPECT_FALSE(f.trial_verdict(1));
  EXPECT_FALSE(f.trial_verdict(5));  // past the end: the last
  EXPECT_EQ(f.kill_rank, 1);
  EXPECT_EQ(f.kill_step, 3);
  EXPECT_EQ(f.io, "flip");
  EXPECT_EQ(f.io_nth, 60);
  EXPECT_EQ(parse_faults("io-read:7").io, "read");
  EXPECT_EQ(parse_faults("io-write:7").io, "write");
  EXPECT_EQ(parse_faults("save-fill:12").save_fill_nth, 12);
  EXPECT_EQ(none.save_fill_nth, 0);
  for (const char* bad : {"save-fill", "save-fill:", "save-fill:x", "kill:1", "io-read:", "io-read:x", "io-read:-1", "flip:60", "separate-optimizer:1", "kil:1:2", "trial-verdicts", "trial-verdicts:", "trial-verdicts:2"})
    EXPECT_THROW(parse_faults(bad), std::invalid_argument) << bad;
}

}  // namespace
}  // namespace strata
