"""FSDP2's shard mesh sliced once per HSDP mesh, not once per parameter.

Why. Under HSDP every `FSDPParam` calls `_init_shard_mesh` (fsdp/_fully_shard/_fsdp_param.py), which slices the
shard dim off its 2-D (replicate, shard) mesh: `mesh[mesh.mesh_dim_names[-1]]`, a new DeviceMesh each time, and
each new DeviceMesh builds its root's rank map as a tuple and this rank's coordinates — O(world) per parameter
(1,184 meshes a rank for the 2B job under HSDP 8; +0.3 s of start-up at 8,192 ranks, bench/RESULTS.md). The
slice depends only on the mesh (its layout, names, root and groups, all fixed once built), and every parameter
of a `fully_shard` call holds the same mesh, so the first slice can serve them all — as torch's own FSDP path
already shares one 1-D mesh object among all parameters. `FSDPParam` only reads the result (the DTensor specs
of `to_sharded_dtensor`, `shard_mesh`), and the shared mesh is equal (same hash) to the one torch would build,
so specs compare equal. `share_shard_meshes` wraps `FSDPParam._init_shard_mesh` to keep torch's result on the
mesh it sliced; a torch without that method, or with another signature, is left alone.
"""

from __future__ import annotations

import functools
import inspect

try:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
except ImportError:  # a torch without FSDP2's module: nothing to wrap
    FSDPParam = None

# where a mesh keeps its shard slice: on the mesh itself, so it lives and dies with it (no process-wide table)
SHARD_MESH_ATTR = "_loom_shard_mesh"


def share_shard_meshes() -> bool:
    """Make FSDP2 slice each HSDP mesh's shard dim once and hand every parameter that slice (idempotent); False
    where torch's code is not the one this was written against (then torch's own runs)."""
    init = getattr(FSDPParam, "_init_shard_mesh", None)
    if init is None:
        return False
    if getattr(init, "loom_shares_shard_mesh", False):
        return True
    if list(inspect.signature(init).parameters) != ["self"]:
        return False

    @functools.wraps(init)
    def shared_shard_mesh(self):
        mesh = self.mesh_info.mesh
        kept = mesh.__dict__.get(SHARD_MESH_ATTR)
        if kept is not None:
            return kept
        shard = init(self)
        if shard is not mesh:  # a 1-D mesh is its own shard mesh: nothing to keep (and no cycle)
            setattr(mesh, SHARD_MESH_ATTR, shard)
        return shard

    shared_shard_mesh.loom_shares_shard_mesh = True
    FSDPParam._init_shard_mesh = shared_shard_mesh
    return True
