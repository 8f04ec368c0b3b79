#include "src/train/memory_remedies.h"

#include <unistd.h>

#include <cstdio>

#include "offload/size.h"

namespace strata {
using offload::Tier;

namespace {

// Takes the first of `moves` that starts with `flag` out of it ("" when none does).
std::string take(std::vector<std::string>& moves, const std::string& flag) {
  for (auto it = moves.begin(); it != moves.end(); ++it)
    if (it->rfind(flag, 0) == 0) {
      std::string m = *it;
      moves.erase(it);
      return m;
    }
  return "";
}

std::string join(const std::vector<std::string>& v, const std::string& last_sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i == 0 ? "" : i + 1 == v.size() ? last_sep : ", ") + v[i];
  return out;
}

}  // namespace

uint64_t physical_ram() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
}

uint64_t host_memory_available() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return 0;
  uint64_t avail = 0, swap = 0;
  char line[256];
  while (std::fgets(line, sizeof(line), f)) {
    unsigned long long kb = 0;
    if (std::sscanf(line, "MemAvailable: %llu kB", &kb) == 1) avail = kb * 1024;
    else if (std::sscanf(line, "SwapFree: %llu kB", &kb) == 1) swap = kb * 1024;
  }
  std::fclose(f);
  return avail ? avail + swap : 0;
}

// The flags that move state off tier t, given what already lives elsewhere (and checkpointing,
// which shrinks what the device keeps of the activations).
std::vector<std::string> moves_off(Tier t, const Placement& pl, bool checkpointing) {
  std::vector<std::string> h;
  if (pl.speculate) h.push_back("--speculate off");  // its second copy of the optimizer state
  if (t == Tier::device) {
    if (pl.optimizer == Tier::device) h.push_back("--offload-optimizer cpu|nvme");
    if (pl.grads == Tier::device) h.push_back("--offload-grads cpu|nvme");
    if (pl.params == Tier::device) h.push_back("--offload-params cpu|nvme");
    if (!checkpointing) h.push_back("--checkpoint-activations full");
  } else if (t == Tier::host) {
    if (pl.optimizer == Tier::host) h.push_back("--offload-optimizer nvme");
    if (pl.grads == Tier::host) h.push_back("--offload-grads nvme");
    if (pl.params == Tier::host) h.push_back("--offload-params nvme");
    if (pl.activations == Tier::host) h.push_back("--offload-activations nvme");
  }
  return h;
}

// The fixes for memory that is too small (a tier, or the machine's RAM: `where`), the one for
// what fills it most first: a run whose activations fill memory is fixed by --batch/--seq or
// checkpointing, not by moving its optimizer state. `h` is what it holds by kind; the buffers
// (the workspace, mostly one block's activations, and the step's own) count with the kept block
// inputs, as both grow with --batch x --seq. `moves` are the flags that move state off it.
std::string remedies(const Homed& h, const std::string& where, bool checkpointing, std::vector<std::string> moves) {
  const auto at = [&](Role r) { return h[static_cast<size_t>(r)]; };
  struct Part {
    const char* what;
    uint64_t bytes;
    const char* flag;  // the --offload-* flag that moves it
  };
  const Part parts[] = {
      {"activations and workspace", at(Role::activations) + h[kNumRoles], "--offload-activations"},
      {"the optimizer state (fp32 master weights and AdamW moments)", at(Role::master) + at(Role::adam),
       "--offload-optimizer"},
      {"the gradients", at(Role::grads), "--offload-grads"},
      {"the parameters", at(Role::params), "--offload-params"},
  };
  const Part* top = &parts[0];
  for (const Part& p : parts)
    if (p.bytes > top->bytes) top = &p;
  std::string out;
  if (top->bytes > 0) {
    out = "; the largest part of " + where + " is " + top->what + " (" + offload::format_size(top->bytes) + ")";
    std::vector<std::string> fix;
    if (top == &parts[0]) {
      fix.push_back("a smaller --batch or --seq (--grad-accum keeps the tokens per step)");
      if (std::string c = take(moves, "--checkpoint-activations"); !c.empty()) fix.push_back(c);
      else if (checkpointing) fix.push_back("--offload-activations cpu|nvme");
      take(moves, top->flag);
      out += ": use " + join(fix, " or ");
    } else if (std::string m = take(moves, top->flag); !m.empty()) {
      out += ": move it with " + m;
    }
  }
  if (!moves.empty()) out += "; or move state off it with " + join(moves, ", ");
  return out;
}


}  // namespace strata
