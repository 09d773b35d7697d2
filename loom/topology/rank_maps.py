"""One copy of each mesh's rank map per process, however many DeviceMesh objects torch makes over it.

Why. torch's `DeviceMesh.__init__` keeps `_flatten_rank_map = tuple(self._rank_map.tolist())` — its root's whole
rank map (a grid's ranks, up to the world) as a tuple of Python ints, for hashing and equality. A slice or a
concatenation of a mesh is a new DeviceMesh with a new tuple, and FSDP2 makes them per parameter, not per
module: `FSDPParam` slices its shard dim off an HSDP mesh (`_init_shard_mesh`) and concatenates dp and tp
meshes for a TP parameter (`_init_sharding_spec_tp`). A rank of the 2B job held 335 such meshes (1,184 under
HSDP), each ~0.3 MiB at 8,192 ranks (8,192 ints of 32 bytes plus the tuple's pointers): 105 MiB (370 MiB) that
grew with the world (bench/RESULTS.md, "A rank's host memory as the world grows"). The tuples of one root are
equal, so every mesh can hold the same one: `share_rank_maps` wraps `DeviceMesh.__init__` to swap its fresh
tuple for the process's copy of an equal one. Hashes and equality are unchanged (equal tuples); each new mesh
still builds its tuple once (O(world) time, freed at once), so what a rank keeps is one tuple per distinct rank
map — a few per job — instead of one per mesh.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import DeviceMesh

# rank map → the one tuple every mesh over it holds. Entries outlive their meshes; there is one per distinct
# rank map a process ever meshed (a grid's ranks: a handful per job, a few more across tests' worlds).
_RANK_MAPS: dict[tuple[int, ...], tuple[int, ...]] = {}
# id(a rank-map tensor) → (that tensor, kept so its id stays its own; its shared tuple): a slice or concatenation
# passes its root's tensor, so finding its tuple skips hashing and comparing O(world) ints (FSDP2: one per parameter)
_BY_TENSOR: dict[int, tuple[torch.Tensor, tuple[int, ...]]] = {}


def share_rank_maps() -> None:
    """Make every DeviceMesh built from now on hold the process's shared copy of its rank map (idempotent)."""
    init = DeviceMesh.__init__
    if getattr(init, "loom_shares_rank_map", False):
        return

    @functools.wraps(init)
    def shared_init(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        mine = getattr(self, "_flatten_rank_map", None)  # a torch without it keeps no such copy: nothing to share
        if mine is None:
            return
        tensor = getattr(self, "_rank_map", None)
        known = _BY_TENSOR.get(id(tensor))
        if known is not None and known[0] is tensor:
            self._flatten_rank_map = known[1]
            return
        self._flatten_rank_map = _RANK_MAPS.setdefault(mine, mine)
        if isinstance(tensor, torch.Tensor):
            _BY_TENSOR[id(tensor)] = (tensor, self._flatten_rank_map)

    shared_init.loom_shares_rank_map = True
    DeviceMesh.__init__ = shared_init


def rank_map_copies(meshes) -> int:
    """How many distinct rank-map tuples `meshes` hold (1 per distinct map when shared): for tests and benches."""
    return len({id(m._flatten_rank_map) for m in meshes})
