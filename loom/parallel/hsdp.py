"""HSDP (`[layout.<module>] shard = S`): FSDP2 shards a module's weights within runs of S of its dp·cp ranks and
replicates the shards across the dp·cp/S runs — gradients reduce-scattered within a run, then all-reduced
across the runs (FSDP2's 2-D (replicate, shard) mesh).

Why. Plain FSDP2 cuts every parameter into dp·cp chunks on every rank at start-up (torch's `_chunk_with_empty`),
O(parameters × dp·cp): 34 s at dp 8,192 for the 2B job (bench/RESULTS.md). With S fixed (e.g. a node's GPUs)
that work, the gathers' peers and a rank's shard sizes stop growing with the world; the state per rank is the
module's / (tp·pp·S) instead of / (tp·pp·dp·cp).

Which ranks. dp×cp in grid order (cp fastest), cut into runs of S consecutive ranks, per pp stage and tp
coordinate (as parallel/experts.py cuts them into runs of ep): a run is a shard group, the ranks at one place
of every run a replicate group. Both are registry groups (one world-wide call per partition, none of one
rank), and the mesh [pp, replicate, shard, tp] is built over them, its "tp" the one TP uses, so TP's DTensors
and FSDP2's mesh share one root.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from loom.topology import Grid, Topology

MESH_DIMS = ("pp", "replicate", "shard", "tp")


def _arranged(grid: Grid) -> torch.Tensor:
    """The grid's ranks as [pp, replicas, shard, tp]: dp×cp in grid order, cut into runs of `shard`. The same
    rank order as the grid's [pp, dp, cp, tp] (a reshape), so both meshes map ranks alike."""
    lay = grid.layout
    return grid.ranks.reshape(lay.pp, lay.shard_replicas, lay.shard_size, lay.tp)


def _group_names(grid: Grid) -> tuple[str, str]:
    """The registry names of the shard and replicate groups: from the grid's ranks and degrees, so colocated
    modules with one layout and one `shard` share them (one world-wide call, not two)."""
    lay = grid.layout
    where = f"ranks {lay.start}-{lay.ranks[-1]} pp{lay.pp} tp{lay.tp} shard {lay.shard_size}"
    return f"hsdp: one shard run ({where})", f"hsdp: the replicas of a shard ({where})"


def add_shard_groups(topo: Topology) -> None:
    """The shard and replicate groups of every module under HSDP; every rank calls it, in one order (creating
    groups is a world-wide call)."""
    for grid in topo.grids.values():
        lay = grid.layout
        if not lay.fsdp or lay.shard_replicas == 1:
            continue
        ranks, (shard_name, replicate_name) = _arranged(grid), _group_names(grid)
        runs = ranks.permute(0, 1, 3, 2).reshape(-1, lay.shard_size)
        replicas = ranks.permute(0, 2, 3, 1).reshape(-1, lay.shard_replicas)
        topo.registry.add(shard_name, [tuple(r) for r in runs.tolist()])
        topo.registry.add(replicate_name, [tuple(r) for r in replicas.tolist()])


def hsdp_root(grid: Grid, device_type: str) -> DeviceMesh:
    """This rank's [pp, replicate, shard, tp] mesh over the registry's groups, built once per grid and device."""
    key = ("hsdp", device_type)
    if key not in grid.meshes:
        shard_name, replicate_name = _group_names(grid)
        groups = [grid.group("pp"), grid.registry.named(replicate_name), grid.registry.named(shard_name),
                  grid.group("tp")]
        grid.meshes[key] = DeviceMesh.from_group(groups, device_type, mesh=_arranged(grid), mesh_dim_names=MESH_DIMS)
    return grid.meshes[key]
