"""Which process groups exist, and the registry that creates them once, in one order, on every rank.

`GROUP_DIMS` is the one list of dim sets that code asks a grid for (`Grid.group(*dims)`, `Grid.mesh`,
`Grid.flat_mesh`); each entry names its users. For every grid, in module order, the registry creates the
group of each rank set of each listed dim set, in list order, then grid order. `new_group` is a collective
over the whole world, so every rank must make the same calls in the same order: the list and the grids are
the same on every rank. A dim set that is not listed has no group: `Grid.group` says which line to add.
Reductions over the whole world (the grad norm and loss in train/optim.py, train/step.py) use the default
group, which exists already.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from loom.topology.grid import Grid
from loom.topology.layout import DIMS

# dims (in DIMS order) → the code that asks for their groups. New code that needs another dim set adds one line.
GROUP_DIMS: dict[tuple[str, ...], str] = {
    ("pp",): "the grid's DeviceMesh (Grid.mesh); the pipeline schedule (train/rank_plan.py)",
    ("dp",): "the grid's DeviceMesh; FSDP2 without cp (`fsdp_mesh`, parallel/fsdp.py)",
    ("cp",): "the grid's DeviceMesh; CP attention and the bridges' sum over cp (train/rank_plan.py, bridge/)",
    ("tp",): "the grid's DeviceMesh (TP plans); colocated fan-out and its debug check (bridge/colocated.py)",
    ("dp", "cp"): "FSDP2's shard group under cp, dp×cp flattened (Grid.flat_mesh, `fsdp_mesh` in parallel/fsdp.py)",
    ("cp", "tp"): "colocated fan-in: the ranks of one LLM replica (bridge/colocated.py)",
    ("pp", "dp", "cp", "tp"): "every rank of a grid: the first-stage bridge (bridge/first_stage.py)",
}


class MissingGroupError(LookupError):
    """A grid was asked for a dim set the registry does not create."""


# Process-wide: a rank set gets one group for the life of the process. DTensor caches sharding decisions by
# mesh *equality* (ranks and dim names, not groups), so a second, equal mesh over new groups would be served
# stale groups; sharing the groups across topologies (tests, `verify` after `train`) rules that out.
_GROUPS: dict[tuple, dist.ProcessGroup | None] = {}


class GroupRegistry:
    """Creates the groups of `dim_sets` (default: GROUP_DIMS) for every grid, once per process.

    All ranks call `build(grids)` with the same grids in the same order; identical rank sets (e.g. dp and
    dp×cp when cp = 1, or two colocated modules with the same layout) share one group. `destroy_all()`
    releases them at shutdown.
    """

    def __init__(self, dim_sets: tuple[tuple[str, ...], ...] | None = None, timeout: timedelta | None = None) -> None:
        self.dim_sets = tuple(GROUP_DIMS) if dim_sets is None else tuple(dim_sets)
        for dims in self.dim_sets:
            if not dims or tuple(d for d in DIMS if d in dims) != tuple(dims):
                raise ValueError(f"group dims {dims} must be a non-empty subset of {DIMS}, in that order")
        self.created = 0  # groups this registry created (rank sets no earlier build had)
        self.timeout = timeout  # of every group's collectives (new_group does not take the world's)
        self._groups = _GROUPS
        self._named: dict[str, list[tuple[int, ...]]] = {}  # add(): name → its rank sets
        self._backends: dict[str, str | None] = {}  # add(): name → its groups' backend (None: the default)

    def build(self, grids: list[Grid]) -> None:
        for grid in grids:
            grid.registry = self
            for dims in self.dim_sets:
                for ranks in grid.rank_sets(*dims):
                    self._create(ranks)

    def _create(self, ranks: tuple[int, ...], backend: str | None = None, name: str = "") -> None:
        """The group over `ranks`, unless an earlier set was the same: every rank calls it (a world collective).
        `backend`: other than the default's; such a group is `name`'s own (no other user shares its queue)."""
        key = _key(ranks, backend, name)
        if key not in self._groups:
            group = dist.new_group(list(ranks), backend=backend, timeout=self.timeout)
            self._groups[key] = group if dist.get_rank() in ranks else None
            self.created += 1

    def get(self, dims: tuple[str, ...], ranks: tuple[int, ...], module: str) -> dist.ProcessGroup:
        """The group over `ranks`, the set of `module`'s grid varying along `dims` (in DIMS order)."""
        if dims not in self.dim_sets:
            raise MissingGroupError(
                f"the {module} grid has no process group over dims {dims}: groups exist only for "
                f"{list(self.dim_sets)}. Add {dims!r} with the code that needs it to GROUP_DIMS in "
                "loom/topology/groups.py")
        group = self._groups.get(tuple(ranks))
        if group is None:
            raise KeyError(f"no process group for ranks {ranks} on rank {dist.get_rank()}")
        return group

    def add(self, name: str, rank_sets: list[tuple[int, ...]], backend: str | None = None) -> None:
        """Groups that are no grid's dim set, under `name` (e.g. parallel/tied.py's pairs of a tied embedding's
        stage-0 and last-stage ranks). Every rank calls it after build(), with the same sets in one order."""
        self._named[name] = [tuple(ranks) for ranks in rank_sets]
        self._backends[name] = backend
        for ranks in self._named[name]:
            self._create(ranks, backend, name)

    def named(self, name: str) -> dist.ProcessGroup | None:
        """This rank's group among the sets added as `name`; None when it is in none of them."""
        me, backend = dist.get_rank(), self._backends[name]
        return next((self._groups[_key(ranks, backend, name)] for ranks in self._named[name] if me in ranks), None)

    @staticmethod
    def destroy_all() -> None:
        """At shutdown: every group this process created, before the default group goes."""
        for group in _GROUPS.values():
            if group is not None:
                dist.destroy_process_group(group)
        _GROUPS.clear()


def _key(ranks: tuple[int, ...], backend: str | None, name: str) -> tuple:
    """Default-backend groups are shared by every user of the same ranks; another backend's belong to `name`."""
    return ranks if backend is None else (backend, name, ranks)
