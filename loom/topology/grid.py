"""The rank grid of one layout: coordinates, rank sets for any subset of dims, and their process groups.

Ranks of a grid are laid out as a [pp, dp, cp, tp] array over its contiguous range (tp fastest).
`rank_sets(dims)` partitions the grid into the groups that vary along `dims` with the other dims fixed;
`group(*dims)` is this rank's member of that partition. Groups are created by `GroupRegistry`, on every
rank of the world in one fixed order, because `new_group` is a collective over the whole world.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from loom.topology.layout import DIMS, Layout


class Grid:
    def __init__(self, layout: Layout, registry: GroupRegistry | None = None) -> None:
        self.layout = layout
        self.shape = tuple(layout.degree(d) for d in DIMS)
        self.ranks = torch.arange(layout.start, layout.start + layout.size).reshape(self.shape)
        self.registry = registry
        self._root_mesh: DeviceMesh | None = None

    @property
    def module(self) -> str:
        return self.layout.module

    def contains(self, rank: int) -> bool:
        return rank in self.layout.ranks

    def coord(self, rank: int) -> dict[str, int]:
        if not self.contains(rank):
            raise ValueError(f"rank {rank} is not in the {self.module} grid (ranks {self.layout.describe()})")
        idx = (self.ranks == rank).nonzero()[0].tolist()
        return dict(zip(DIMS, idx))

    def rank_at(self, **coord: int) -> int:
        """Inverse of coord(); every dim must be given."""
        missing = set(DIMS) - set(coord)
        if missing:
            raise ValueError(f"rank_at needs every dim; missing {sorted(missing)}")
        return int(self.ranks[tuple(coord[d] for d in DIMS)])

    def rank_sets(self, *dims: str) -> list[tuple[int, ...]]:
        """All groups that vary along `dims` (others fixed), each in grid order."""
        dims = _ordered(dims)
        keep = [DIMS.index(d) for d in dims]
        other = [i for i in range(len(DIMS)) if i not in keep]
        moved = self.ranks.permute(*other, *keep).reshape(-1, _numel(self.shape, keep))
        return [tuple(row.tolist()) for row in moved]

    def members(self, rank: int, *dims: str) -> tuple[int, ...]:
        """The ranks of `rank`'s group along `dims`."""
        for ranks in self.rank_sets(*dims):
            if rank in ranks:
                return ranks
        raise ValueError(f"rank {rank} is not in the {self.module} grid")

    def group(self, *dims: str) -> dist.ProcessGroup:
        """This rank's process group along `dims` (created up front by the registry)."""
        if self.registry is None:
            raise RuntimeError(f"the {self.module} grid has no process groups (built without a registry)")
        rank = dist.get_rank()
        if not self.contains(rank):
            raise ValueError(f"rank {rank} is not in the {self.module} grid ({self.layout.describe()})")
        return self.registry.get(self.members(rank, *dims))

    def mesh(self, *dims: str, device_type: str = "cpu") -> DeviceMesh:
        """A DeviceMesh over `dims` for this rank, sliced from the grid's full [pp, dp, cp, tp] mesh so that
        all of a module's meshes share one root (FSDP2 + TP need that); built from the registry's groups,
        so no new collective runs."""
        dims = _ordered(dims)
        if self._root_mesh is None or self._root_mesh.device_type != device_type:
            groups = [self.group(d) for d in DIMS]
            self._root_mesh = DeviceMesh.from_group(groups, device_type, mesh=self.ranks, mesh_dim_names=DIMS)
        return self._root_mesh[dims if len(dims) > 1 else dims[0]]


# Process-wide: a rank set gets one group for the life of the process. DTensor caches sharding decisions by
# mesh *equality* (ranks and dim names, not groups), so a second, equal mesh over new groups would be served
# stale groups; sharing the groups across topologies (tests, `verify` after `train`) rules that out.
_GROUPS: dict[tuple[int, ...], dist.ProcessGroup | None] = {}


class GroupRegistry:
    """Creates every process group of every grid, once per process.

    All ranks call `build(grids)` with the same grids in the same order; identical rank sets (e.g. two
    colocated modules with the same layout) share one group. `destroy_all()` releases them at shutdown.
    """

    def __init__(self) -> None:
        self._groups = _GROUPS

    def build(self, grids: list[Grid]) -> None:
        me = dist.get_rank()
        for grid in grids:
            grid.registry = self
            for dims in all_dim_subsets():
                for ranks in grid.rank_sets(*dims):
                    if ranks not in self._groups:
                        group = dist.new_group(list(ranks))  # every rank calls it: world collective
                        self._groups[ranks] = group if me in ranks else None

    def get(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        group = self._groups.get(tuple(ranks))
        if group is None:
            raise KeyError(f"no process group for ranks {ranks} on rank {dist.get_rank()}")
        return group

    @staticmethod
    def destroy_all() -> None:
        """At shutdown: every group this process created, before the default group goes."""
        for group in _GROUPS.values():
            if group is not None:
                dist.destroy_process_group(group)
        _GROUPS.clear()


def all_dim_subsets() -> list[tuple[str, ...]]:
    """Every non-empty subset of DIMS, in one fixed order."""
    return [c for n in range(1, len(DIMS) + 1) for c in itertools.combinations(DIMS, n)]


def _ordered(dims: tuple[str, ...]) -> tuple[str, ...]:
    unknown = set(dims) - set(DIMS)
    if unknown or not dims:
        raise ValueError(f"dims {dims} must be a non-empty subset of {DIMS}")
    return tuple(d for d in DIMS if d in dims)


def _numel(shape: tuple[int, ...], keep: list[int]) -> int:
    n = 1
    for i in keep:
        n *= shape[i]
    return n
