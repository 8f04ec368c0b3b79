// The (dp, pp, tp) grid and its process groups (src/comm/grid.h).
#include "src/comm/grid.h"

#include <fmt/format.h>

#include <stdexcept>

namespace strata {

GridShape grid_shape(int world, int tp, int pp) {
  if (tp < 1) throw std::invalid_argument(fmt::format("--tp {}: must be at least 1", tp));
  if (pp < 1) throw std::invalid_argument(fmt::format("--pp {}: must be at least 1", pp));
  if (world % (tp * pp) != 0)
    throw std::invalid_argument(fmt::format(
        "--tp {} × --pp {} = {} does not divide the {} rank{} of this job: start a multiple of {} ranks "
        "(mpirun -n), or change --tp/--pp",
        tp, pp, tp * pp, world, world == 1 ? "" : "s", tp * pp));
  return GridShape{tp, pp, world / (tp * pp)};
}

GridCoord grid_coord(const GridShape& g, int rank) {
  return GridCoord{rank % g.tp, (rank / g.tp) % g.pp, rank / (g.tp * g.pp)};
}

int grid_rank(const GridShape& g, const GridCoord& c) { return (c.dp * g.pp + c.pp) * g.tp + c.tp; }

std::string grid_name(const GridShape& g) { return fmt::format("dp {} × pp {} × tp {}", g.dp, g.pp, g.tp); }

ProcessGroups::ProcessGroups(Communicator& world, int tp, int pp)
    : world_(world), shape_(grid_shape(world.world(), tp, pp)), coord_(grid_coord(shape_, world.rank())) {
  const GridShape& g = shape_;
  const GridCoord& c = coord_;
  // Each group's color: the rank's coordinates on the other axes; its key: the coordinate on
  // this axis, so a group's ranks are ordered along it. Every rank makes every split, in the
  // same order (a split is collective over the world).
  // An axis of size 1 is this rank alone: a local communicator, no split.
  tp_ = g.tp > 1 ? world.split(c.dp * g.pp + c.pp, c.tp) : make_local_communicator();
  pp_ = g.pp > 1 ? world.split(c.dp * g.tp + c.tp, c.pp) : make_local_communicator();
  if (g.tp > 1 || g.pp > 1) dp_owned_ = world.split(c.pp * g.tp + c.tp, c.dp);
}

}  // namespace strata
