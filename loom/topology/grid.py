"""The rank grid of one layout: coordinates, rank sets for any subset of dims, their groups and meshes.

Ranks of a grid are laid out as a [pp, dp, cp, tp] array over its contiguous range (tp fastest).
`rank_sets(dims)` partitions the grid into the groups that vary along `dims` with the other dims fixed;
`group(*dims)` is this rank's member of that partition. Groups are created up front by `GroupRegistry`
(topology/groups.py), only for the dim sets listed there. A rank's own coordinates and set are worked out from
its rank alone (`coord`, `members`), so what a rank does for itself does not grow with the grid.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed._mesh_layout import _MeshLayout
from torch.distributed.device_mesh import DeviceMesh

from loom.topology.layout import DIMS, Layout
from loom.topology.rank_maps import share_rank_maps

# before any mesh is built: FSDP2 makes DeviceMeshes per parameter, each would keep its own copy of the grid's
# rank map (O(world) Python ints); topology/rank_maps.py makes them share one
share_rank_maps()


class GroupSource(Protocol):
    """Where a grid's process groups come from: topology/groups.py's GroupRegistry, which creates them up front."""

    def get(self, dims: tuple[str, ...], ranks: tuple[int, ...], module: str) -> dist.ProcessGroup: ...


class Grid:
    def __init__(self, layout: Layout, registry: GroupSource | None = None) -> None:
        self.layout = layout
        self.shape = tuple(layout.degree(d) for d in DIMS)
        self.ranks = torch.arange(layout.start, layout.start + layout.size).reshape(self.shape)
        self.registry = registry
        self._root_mesh: DeviceMesh | None = None
        self.meshes: dict[tuple, DeviceMesh] = {}  # other meshes over this grid's groups, by their builder's key

    @property
    def module(self) -> str:
        return self.layout.module

    def contains(self, rank: int) -> bool:
        return rank in self.layout.ranks

    def coord(self, rank: int) -> dict[str, int]:
        if not self.contains(rank):
            raise ValueError(f"rank {rank} is not in the {self.module} grid (ranks {self.layout.describe()})")
        offset, idx = rank - self.layout.start, []
        for degree in reversed(self.shape):  # mixed-radix digits, tp fastest
            offset, digit = divmod(offset, degree)
            idx.append(digit)
        return dict(zip(DIMS, reversed(idx)))

    def size(self, *dims: str) -> int:
        """The ranks in each set along `dims`: the product of their degrees (1: every set is one rank)."""
        return _numel(self.shape, [DIMS.index(d) for d in _ordered(dims)])

    def partition_key(self, *dims: str) -> tuple:
        """Equal for two grids' partitions along dims exactly when their rank sets are equal, from the degrees alone:
        the first rank, the size, and the kept dims' (stride, degree) with degree-1 dims dropped and neighbours
        merged where one's span is the next one's stride (ranks are [pp, dp, cp, tp] row-major)."""
        strides = [_numel(self.shape, list(range(i + 1, len(DIMS)))) for i in range(len(DIMS))]
        kept: list[tuple[int, int]] = []
        for i in sorted((DIMS.index(d) for d in _ordered(dims)), reverse=True):  # by stride, smallest first
            if self.shape[i] == 1:
                continue
            if kept and kept[-1][0] * kept[-1][1] == strides[i]:
                kept[-1] = (kept[-1][0], kept[-1][1] * self.shape[i])
            else:
                kept.append((strides[i], self.shape[i]))
        return (self.layout.start, self.layout.size, tuple(kept))

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
        return [tuple(row) for row in moved.tolist()]  # one tolist: a tensor per row cost ~µs a set, O(world)

    def members(self, rank: int, *dims: str) -> tuple[int, ...]:
        """The ranks of `rank`'s group along `dims`, in grid order."""
        dims, at = _ordered(dims), self.coord(rank)
        return tuple(self.ranks[tuple(slice(None) if d in dims else at[d] for d in DIMS)].flatten().tolist())

    def group(self, *dims: str) -> dist.ProcessGroup:
        """This rank's process group along `dims` (created up front by the registry); a rank alone along `dims`
        gets the registry's stand-in, on which a collective raises: callers skip theirs when `size(*dims)` is 1."""
        if self.registry is None:
            raise RuntimeError(f"the {self.module} grid has no process groups (built without a registry)")
        rank = dist.get_rank()
        if not self.contains(rank):
            raise ValueError(f"rank {rank} is not in the {self.module} grid ({self.layout.describe()})")
        return self.registry.get(_ordered(dims), self.members(rank, *dims), self.module)

    def mesh(self, *dims: str, device_type: str = "cpu") -> DeviceMesh:
        """A DeviceMesh over `dims` for this rank, sliced from the grid's full [pp, dp, cp, tp] mesh so that
        all of a module's meshes share one root (FSDP2 + TP need that); built from the registry's groups (a
        degree-1 dim: the stand-in, which DTensor and FSDP2 never call), so no new collective runs."""
        dims = _ordered(dims)
        if self._root_mesh is None or self._root_mesh.device_type != device_type:
            groups = [self.group(d) for d in DIMS]
            self._root_mesh = DeviceMesh.from_group(groups, device_type, mesh=self.ranks, mesh_dim_names=DIMS)
        return self._root_mesh[dims if len(dims) > 1 else dims[0]]

    def flat_mesh(self, *dims: str, device_type: str = "cpu") -> DeviceMesh:
        """A 1-D DeviceMesh over `dims` flattened into one dim named "_".join(dims) (e.g. FSDP2 sharding over
        dp×cp), over the registry's group for `dims`; like `DeviceMesh._flatten` it hangs off the grid's root
        mesh, so FSDP2 + TP still share one root, but `_flatten` would create groups outside the registry."""
        dims = _ordered(dims)
        root = self.mesh(*DIMS, device_type=device_type)
        if len(dims) == 1:
            return root[dims[0]]
        name = "_".join(dims)
        if name not in root._flatten_mapping:
            group = self.group(*dims)
            # private constructor: from_group makes a mesh its own root, and FSDP2 + TP need this one under root
            flat = DeviceMesh(device_type, _layout=_flat_layout(root[dims]._layout),
                              _rank_map=root._rank_map, mesh_dim_names=(name,), _root_mesh=root, _init_backend=False)
            flat._dim_group_names = [group.group_name]  # _init_backend=False made none: the registry's group
            root._pg_registry[group.group_name] = group  # where compiled code looks groups up
            root._flatten_mapping[name] = flat  # a later root[dims]._flatten(name) returns this one
        return root._flatten_mapping[name]


def _flat_layout(layout: _MeshLayout) -> _MeshLayout:
    """`layout`'s dims merged into one, as DeviceMesh._flatten merges them (its layout API differs by version)."""
    if hasattr(layout, "collapse"):  # torch ≥ 2.13
        return _MeshLayout([layout.collapse()])
    flat = layout.coalesce()  # torch 2.11/2.12: dims whose strides chain merge; others nest as one dim
    return flat.nest() if len(flat) > 1 else flat


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
