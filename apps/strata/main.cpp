// strata: the command line. Parses with CLI11, dispatches to one subcommand, and turns any
// error into one clear line on stderr and a non-zero exit status.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "apps/strata/commands.h"
#include "src/comm/communicator.h"

namespace {

// Levenshtein distance, for suggesting the command a typo meant.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// The error for `word` where a subcommand of `parent` must come: the nearest name (a swap of
// two letters counts as two edits, so up to 2 edits, or a third of a long word), else the list.
// Empty when `word` is one of them. `prefix` is what precedes it ("strata ", "strata bench ").
std::string unknown_command(const CLI::App& parent, const std::string& word, const std::string& prefix) {
  std::vector<std::string> names;
  for (const CLI::App* sub : parent.get_subcommands([](const CLI::App*) { return true; }))
    names.push_back(sub->get_name());
  if (std::find(names.begin(), names.end(), word) != names.end()) return {};
  std::string best, list;
  size_t best_d = std::max<size_t>(2, word.size() / 3) + 1;
  for (const std::string& n : names) {
    list += (list.empty() ? "" : ", ") + n;
    // Never a name that shares nothing with the word ("xx" is 2 edits from "io" too).
    if (const size_t d = edit_distance(word, n); d < best_d && d < std::min(word.size(), n.size())) best_d = d, best = n;
  }
  const std::string head = "unknown command '" + prefix + word + "'";
  return best.empty() ? head + ": expected one of " + list : head + ": did you mean '" + prefix + best + "'?";
}

// Every option of `app` and its subcommands, depth first.
void all_options(const CLI::App& app, std::vector<const CLI::Option*>& out) {
  for (const CLI::Option* o : app.get_options()) out.push_back(o);
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) all_options(*sub, out);
}

// CLI11 words a single-valued flag given twice as "--steps: At Most 1 required but received 2";
// this names the flag, what it was given and the fix. Empty when the error is another mismatch.
std::string repeated_flag(const CLI::App& app, const CLI::ArgumentMismatch& e) {
  const std::string what = e.what();
  if (what.find("At Most") == std::string::npos) return {};
  std::vector<const CLI::Option*> options;
  all_options(app, options);
  for (const CLI::Option* o : options) {
    const std::string name = o->get_name();
    if (name.empty() || what.rfind(name + ":", 0) != 0 || o->results().size() < 2) continue;
    const std::vector<std::string>& v = o->results();
    std::string values;
    for (size_t i = 0; i < v.size(); ++i)
      values += (i == 0 ? "" : i + 1 == v.size() ? " and " : ", ") + v[i];
    const std::string times = v.size() == 2 ? "twice" : std::to_string(v.size()) + " times";
    return name + " given " + times + " (" + values + "): give it once";
  }
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"strata: train and fine-tune transformers across GPU memory, pinned host RAM and NVMe"};
  app.require_subcommand(1);
  strata::app::Run run;

  CLI::App* bench = app.add_subcommand("bench", "Measure kernels, I/O, offload and training steps (JSON lines)");
  bench->require_subcommand(1);
  strata::app::register_bench_ops(*bench, run);
  strata::app::register_bench_io(*bench, run);
  strata::app::register_bench_offload(*bench, run);
  strata::app::register_bench_step(*bench, run);
  strata::app::register_bench_tokenizer(*bench, run);
  strata::app::register_bench_generate(*bench, run);
  strata::app::register_train(app, run);
  strata::app::register_plan(app, run);
  strata::app::register_inspect(app, run);
  strata::app::register_data(app, run);
  strata::app::register_tokenize(app, run);
  strata::app::register_generate(app, run);

  // A mistyped command: CLI11 would say only that a subcommand is required. Neither `strata`
  // nor `strata bench` takes anything but --help before its subcommand, so the first word that
  // is not a flag must name one.
  if (argc > 1 && argv[1][0] != '-') {
    std::string bad = unknown_command(app, argv[1], "strata ");
    if (bad.empty() && std::string(argv[1]) == "bench" && argc > 2 && argv[2][0] != '-')
      bad = unknown_command(*bench, argv[2], "strata bench ");
    if (!bad.empty()) return app.exit(CLI::ExtrasError(bad, CLI::ExitCodes::ExtrasError));
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ArgumentMismatch& e) {
    const std::string repeated = repeated_flag(app, e);
    return repeated.empty() ? app.exit(e) : app.exit(CLI::ArgumentMismatch(repeated));
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return run ? run() : 0;
  } catch (const std::exception& e) {
    // One line naming the error; in an mpirun job, also which rank, and the job is taken down
    // (the other ranks may be waiting for this one in a collective).
    return strata::report_fatal_error(e.what());
  }
}
