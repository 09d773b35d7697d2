"""FSDP2 over a module's dp group (dp×cp flattened under cp; HSDP's runs under `shard`: `fsdp_mesh`): each
block (or run of `blocks_per_unit` blocks) is its own unit, then the root. Each unit's all-gather is issued
`prefetch` units ahead of its use, in forward and in backward, and the last unit keeps its weights from its
forward to its backward, which follows at once.

Gradients are *summed* over dp (divide factor 1): the loss is already divided by the global token count,
so a mean over replicas would divide twice.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from loom.parallel.fsdp_chunks import chunk_lazily
from loom.parallel.fsdp_shard_mesh import share_shard_meshes
from loom.parallel.hsdp import hsdp_root

if TYPE_CHECKING:
    from loom.config import ParallelConfig
    from loom.topology import Grid

# A row-wise TP projector hands FSDP a view of its local output; loom never writes into module outputs in
# place, which is the only case the warning is about.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
# before any fully_shard: torch cuts every parameter into dp chunks on every rank; fsdp_chunks.py makes the two read
chunk_lazily()
# and under HSDP slices its shard mesh per parameter (O(world) each); fsdp_shard_mesh.py slices it once per mesh
share_shard_meshes()


def fsdp_mesh(grid: Grid, device_type: str) -> DeviceMesh:
    """What FSDP2 shards a module over: its dp ranks, or under cp its dp × cp ranks as one flattened dim, so
    parameter and optimizer memory falls with dp too; under `shard = S` (HSDP, parallel/hsdp.py) the 2-D
    (replicate, shard) mesh over runs of S of them. Gradients are summed over all dp·cp ranks, and the mesh
    shares `tp_mesh`'s root."""
    if grid.layout.shard_replicas > 1:
        return hsdp_root(grid, device_type)["replicate", "shard"]
    if grid.layout.cp > 1:
        return grid.flat_mesh("dp", "cp", device_type=device_type)
    return grid.mesh("dp", device_type=device_type)


def tp_mesh(grid: Grid, device_type: str) -> DeviceMesh:
    """What TP splits a module over: the tp dim of the same root as `fsdp_mesh` (FSDP2 shards TP's DTensors
    only over a mesh of their root)."""
    if grid.layout.shard_replicas > 1:
        return hsdp_root(grid, device_type)["tp"]
    return grid.mesh("tp", device_type=device_type)


ENCODER_UNITS = 3  # an encoder's blocks, by default, in this many units: see blocks_per_unit


def blocks_per_unit(module: str, blocks: int, par: ParallelConfig) -> int:
    """Blocks in one FSDP2 unit of `module` (of `blocks`): its entry in parallel.module_blocks_per_unit; else the
    LLM's parallel.blocks_per_unit, an encoder's a third of its blocks. An encoder's blocks are short (the 0.4B
    ViT's 27 take ~1 ms each at 16K tokens) and FSDP2's hooks around each took the host longer than the block
    took the GPU: on 4 H200s the 2B step ran 1.16× faster with units of 3 ViT blocks than of one, and 1.06× faster
    again with units of 9 and the 4 audio blocks in one (two calls; bench/RESULTS.md, 2026-11-27)."""
    if module in par.module_blocks_per_unit:
        return par.module_blocks_per_unit[module]
    return par.blocks_per_unit if module == "language" else max(1, -(-blocks // ENCODER_UNITS))


def mixed_precision(dtype: str, reduce_dtype: str = "fp32") -> MixedPrecisionPolicy:
    """bf16: compute in bf16, keep fp32 master weights, reduce gradients in `reduce_dtype` (bf16 halves the
    reduce-scatters' bytes, each rank's bf16 gradient summed in bf16)."""
    if dtype == "bf16":
        reduce = torch.bfloat16 if reduce_dtype == "bf16" else torch.float32
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    return MixedPrecisionPolicy()


def apply_fsdp(
    module: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    mp: MixedPrecisionPolicy,
    reshard_after_forward: bool,
    blocks_per_unit: int = 1,
    prefetch: int = 1,
) -> None:
    # a frozen module (train.<module>.freeze) has no backward to reshard its units in: they reshard after forward,
    # or its whole weights would stay gathered on every rank from one forward to the next
    trained = any(p.requires_grad for p in module.parameters())
    # a unit of k consecutive blocks: one all-gather / reduce-scatter and one set of hooks for all k
    units = [blocks[i : i + blocks_per_unit] for i in range(0, len(blocks), blocks_per_unit)]
    for i, unit in enumerate(units):
        # the last unit's backward is the first to run, right after its forward: a reshard would only re-gather
        keep = trained and (not reshard_after_forward or i == len(units) - 1)
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=mp, reshard_after_forward=not keep)
    # the root of a trained module keeps its parameters gathered after forward: the backward needs them at once
    fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=not trained)
    if prefetch:
        set_prefetch(module, [unit[0] for unit in units], prefetch, trained)
    gloo = dist.get_backend(mesh.get_group(0)) == "gloo"
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            if gloo:  # gloo has no PREMUL_SUM; NCCL keeps its fused pre-multiplied reduction
                m.set_force_sum_reduction_for_comms(True)


def set_prefetch(root: nn.Module, units: list[nn.Module], depth: int, backward: bool) -> None:
    """Each unit's all-gather issued when the unit `depth` places before it starts (the root's with the first
    units'), in forward and, for a trained module, in backward's reverse order. Without this FSDP2 issues a
    forward gather only when its unit is called: a host that is not far ahead of the device (short encoder
    blocks, hooks between them) leaves the gather exposed."""
    chain = [root, *units]
    for i, unit in enumerate(chain[:-1]):
        unit.set_modules_to_forward_prefetch(chain[i + 1 : i + 1 + depth])
    if backward:
        for i in range(len(units) - 1, 0, -1):
            units[i].set_modules_to_backward_prefetch(units[max(0, i - depth) : i][::-1])


def reshard(model: nn.Module) -> None:
    """Frees every FSDP2 unit's unsharded parameters, so the next forward gathers them from the shards again.
    The root unit keeps its unsharded parameters after a forward (reshard_after_forward=False): values
    swapped into the shards for one pass (rl/reference.py) must not outlive the swap there — without this,
    `loom verify` saw the step's updates of the root's parameters differ (tests/test_reference.py)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
