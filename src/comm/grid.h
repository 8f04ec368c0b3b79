// The parallel grid (Megatron-LM's process groups): one world of ranks as a (dp, pp, tp) grid,
// tensor-parallel ranks fastest, so a tp group is tp consecutive ranks (one node's GPUs, where
// its all-reduces are cheapest), then pipeline stages, then data-parallel replicas:
//     rank = (dp_index · pp + pp_index) · tp + tp_index
// Each rank belongs to one group per axis: the ranks that differ from it in that axis alone.
#pragma once
#include <memory>
#include <string>

#include "src/comm/communicator.h"

namespace strata {

struct GridShape {
  int tp = 1, pp = 1, dp = 1;
  int world() const { return tp * pp * dp; }
};

// A rank's place in the grid.
struct GridCoord {
  int tp = 0, pp = 0, dp = 0;
};

// dp = world / (tp · pp); throws std::invalid_argument naming --tp, --pp and the world size
// when they are not positive or tp · pp does not divide the world.
GridShape grid_shape(int world, int tp, int pp);
GridCoord grid_coord(const GridShape& g, int rank);
int grid_rank(const GridShape& g, const GridCoord& c);
std::string grid_name(const GridShape& g);  // "dp 2 × pp 1 × tp 2"

// The groups of one rank, split from the world communicator (collective over it, host thread:
// every rank must pass the same tp and pp). An axis of size 1 is a local communicator of this
// rank alone; the data-parallel group of a grid with tp = pp = 1 is the world itself (no split:
// ZeRO runs on the same communicator as without a grid).
class ProcessGroups {
 public:
  ProcessGroups(Communicator& world, int tp, int pp);
  const GridShape& shape() const { return shape_; }
  const GridCoord& coord() const { return coord_; }
  Communicator& world() const { return world_; }
  Communicator& tp() const { return *tp_; }
  Communicator& pp() const { return *pp_; }
  Communicator& dp() const { return dp_owned_ ? *dp_owned_ : world_; }

 private:
  Communicator& world_;
  GridShape shape_;
  GridCoord coord_;
  std::unique_ptr<Communicator> tp_, pp_, dp_owned_;
};

}  // namespace strata
