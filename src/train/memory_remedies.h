// What a run's memory is short of, in words a user acts on: the host's RAM, and the fixes for
// a tier (or the RAM) too small for what the placement puts there (TieredMemory's errors).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "offload/tier.h"
#include "src/train/placement.h"
#include "src/train/run_memory.h"

namespace strata {

// Bytes of RAM this machine has (0 when unknown).
uint64_t physical_ram();
// What the host can still give this process: MemAvailable + SwapFree from /proc/meminfo (0 when
// it cannot be read, and then nothing is checked).
uint64_t host_memory_available();

using Homed = std::array<uint64_t, kNumRoles + 1>;  // bytes by role, then buffers (MemoryPlan::homed)

// The flags that move state off tier t, given what already lives elsewhere (and checkpointing,
// which shrinks what the device keeps of the activations).
std::vector<std::string> moves_off(offload::Tier t, const Placement& pl, bool checkpointing);

// The fixes for memory that is too small (a tier, or the machine's RAM: `where`), the one for
// what fills it most first: a run whose activations fill memory is fixed by --batch/--seq or
// checkpointing, not by moving its optimizer state. `h` is what it holds by kind; the buffers
// (the workspace, mostly one block's activations, and the step's own) count with the kept block
// inputs, as both grow with --batch x --seq. `moves` are the flags that move state off it.
std::string remedies(const Homed& h, const std::string& where, bool checkpointing, std::vector<std::string> moves);

}  // namespace strata
