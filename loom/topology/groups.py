"""Which process groups exist, and the registry that creates them: one world-wide call per partition, in one
order on every rank, each rank keeping only the groups it is a member of.

`GROUP_DIMS` is the one list of dim sets that code asks a grid for (`Grid.group(*dims)`, `Grid.mesh`,
`Grid.flat_mesh`); each entry names its users. For every grid, in module order, and every listed dim set, in
list order, the grid's rank sets along those dims are one partition of its ranks; the registry creates it with
one call (topology/partitions.py: `split_group` on NCCL, the enumeration elsewhere) that every rank makes, in
the same order: the list and the grids are the same on every rank. A partition equal to an earlier one (dp and
dp×cp when cp = 1, two colocated modules with one layout) is not made again, and a dim set whose degree is 1
makes none at all: a rank alone in its set gets `alone()`, a stand-in with no communicator. A dim set that is
not listed has no group: `Grid.group` says which line to add. Reductions over the whole world (the grad norm
and loss in train/optim.py, train/step.py) use the default group, which exists already.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from loom.topology.layout import DIMS
from loom.topology.partitions import alone, create_partition, release_alone

if TYPE_CHECKING:
    from loom.topology.grid import Grid

# dims (in DIMS order) → the code that asks for their groups. New code that needs another dim set adds one line.
GROUP_DIMS: dict[tuple[str, ...], str] = {
    ("pp",): "the grid's DeviceMesh (Grid.mesh); the pipeline schedule (train/rank_plan.py)",
    ("dp",): "the grid's DeviceMesh; FSDP2 without cp (`fsdp_mesh`, parallel/fsdp.py)",
    ("cp",): "the grid's DeviceMesh; CP attention and the bridges' sum over cp (train/rank_plan.py, bridge/)",
    ("tp",): "the grid's DeviceMesh (TP plans); colocated fan-out and its debug check (bridge/colocated.py)",
    ("dp", "cp"): "FSDP2's shard group under cp, dp×cp flattened (Grid.flat_mesh, `fsdp_mesh` in parallel/fsdp.py); "
                  "the experts' load counts (train/expert_load.py)",
    ("cp", "tp"): "colocated fan-in: the ranks of one LLM replica (bridge/colocated.py)",
    ("pp", "dp", "cp", "tp"): "every rank of a grid: the first-stage bridge (bridge/first_stage.py)",
}


class MissingGroupError(LookupError):
    """A grid was asked for a dim set the registry does not create."""


# Process-wide: a partition is made once for the life of the process. DTensor caches sharding decisions by mesh
# *equality* (ranks and dim names, not groups), so a second, equal mesh over new groups would be served stale
# groups; sharing the groups across topologies (tests, `verify` after `train`) rules that out.
_PARTITIONS: set[tuple] = set()  # the keys of the partitions made (the same on every rank)
_MINE: dict[tuple, dist.ProcessGroup] = {}  # this rank's groups: its rank set (or (backend, name, set)) → group
_ALL: list[dist.ProcessGroup] = []  # every group this process holds, for destroy_all (duplicates included)


class GroupRegistry:
    """Creates the groups of `dim_sets` (default: GROUP_DIMS) for every grid, once per process.

    All ranks call `build(grids)` with the same grids in the same order, then `add` with the same sets.
    `created` counts the partitions this registry made (each one world-wide call); `held()` the groups this
    rank holds. `destroy_all()` releases them at shutdown.
    """

    def __init__(self, dim_sets: tuple[tuple[str, ...], ...] | None = None, timeout: timedelta | None = None) -> None:
        self.dim_sets = tuple(GROUP_DIMS) if dim_sets is None else tuple(dim_sets)
        for dims in self.dim_sets:
            if not dims or tuple(d for d in DIMS if d in dims) != tuple(dims):
                raise ValueError(f"group dims {dims} must be a non-empty subset of {DIMS}, in that order")
        self.created = 0  # partitions this registry made (no earlier build had them): world-wide calls
        self.timeout = timeout  # of every group's collectives (new_group does not take the world's)
        self._named: dict[str, tuple] = {}  # add(): name → the key of this rank's group, or None (in no set)
        self._held: set[tuple] = set()  # the keys (in _MINE) of this topology's groups that this rank is in

    def build(self, grids: list[Grid]) -> None:
        me = dist.get_rank()
        for grid in grids:
            grid.registry = self
            for dims in self.dim_sets:
                if grid.size(*dims) == 1:
                    continue  # every set is one rank: no call, alone() stands in
                key = grid.partition_key(*dims)
                mine = grid.members(me, *dims) if grid.contains(me) else None
                self._make(key, mine, lambda g=grid, d=dims: g.rank_sets(*d), grid.members(grid.layout.start, *dims),
                           None, f"{grid.module}:{'x'.join(dims)}")

    def _make(self, key: tuple, mine: tuple[int, ...] | None, sets: Callable[[], list[tuple[int, ...]]],
              other: tuple[int, ...], backend: str | None, desc: str, mine_key: tuple | None = None) -> None:
        """The partition `key` (every rank calls it, in one order), unless an earlier call made it; `mine`: this
        rank's set (None: in none), stored under `mine_key` (default: the set itself)."""
        if mine is not None:
            self._held.add(mine_key or mine)
        if key in _PARTITIONS:
            return
        group = create_partition(sets, mine, other, backend, self.timeout, desc)
        _PARTITIONS.add(key)
        self.created += 1
        if group is not None:
            _ALL.append(group)
            _MINE.setdefault(mine_key or mine, group)  # a set made twice (by unequal partitions) keeps its first

    def get(self, dims: tuple[str, ...], ranks: tuple[int, ...], module: str) -> dist.ProcessGroup:
        """The group over `ranks`, the set of `module`'s grid varying along `dims` (in DIMS order)."""
        if dims not in self.dim_sets:
            raise MissingGroupError(
                f"the {module} grid has no process group over dims {dims}: groups exist only for "
                f"{list(self.dim_sets)}. Add {dims!r} with the code that needs it to GROUP_DIMS in "
                "loom/topology/groups.py")
        if len(ranks) == 1:
            return alone()
        group = _MINE.get(tuple(ranks))
        if group is None:
            raise KeyError(f"no process group for ranks {ranks} on rank {dist.get_rank()}")
        return group

    def add(self, name: str, rank_sets: list[tuple[int, ...]], backend: str | None = None) -> None:
        """Groups that are no grid's dim set, under `name` (e.g. parallel/tied.py's pairs of a tied embedding's
        stage-0 and last-stage ranks): disjoint sets, `name`'s own (not shared with any other user). Every rank
        calls it after build(), with the same sets in one order."""
        sets = [tuple(ranks) for ranks in rank_sets]
        me = dist.get_rank()
        mine = next((s for s in sets if me in s), None)
        self._named[name] = None if mine is None else (backend, name, mine)
        big = [s for s in sets if len(s) > 1]
        if big:
            self._make(("named", backend, name, frozenset(big)), mine if mine in big else None, lambda: big, big[0],
                       backend, name, (backend, name, mine))

    def named(self, name: str) -> dist.ProcessGroup | None:
        """This rank's group among the sets added as `name`; None when it is in none of them."""
        key = self._named[name]
        if key is None:
            return None
        return alone() if len(key[2]) == 1 else _MINE[key]

    def held(self) -> int:
        """The groups of this topology that this rank is in (its communicators under NCCL); stand-ins are none."""
        return len(self._held)

    @staticmethod
    def destroy_all() -> None:
        """At shutdown: every group this process created, before the default group goes."""
        for group in _ALL + release_alone():
            dist.destroy_process_group(group)
        _ALL.clear()
        _MINE.clear()
        _PARTITIONS.clear()
