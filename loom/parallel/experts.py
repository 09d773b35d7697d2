"""Expert parallelism (`[layout.language] ep = N`): each sparse layer's experts split over N ranks, applied
from outside to the MoE blocks' `experts` seam.

Which ranks. EP is a second view of the LLM's dp×cp ranks (per pp stage and tp coordinate): in dp×cp order,
each run of `ep` consecutive ranks is one EP group and holds one copy of all experts, rank j of it experts
j·E/ep … (j+1)·E/ep − 1; the dp×cp/ep ranks at the same place of each run ("efsdp") hold the same experts and
FSDP2 shards them over those. tp ranks stay out of it: they hold the same tokens (gathered under SP), so each
tp coordinate runs its own EP groups and its experts are replicated over tp like the router and the norms.

How tokens travel (parallel/expert_dispatch.py). The MoE block hands the seam its tokens once, with their expert
ids and routing weights [n, k]. A token goes once to each EP rank holding any of its experts, as one row with
which local experts it chose and their weights — not once per choice: at 128 experts, top 8 over ep4 a token
reaches ~3.6 ranks, so ~55% of the rows were duplicates. The destination copies the row once per chosen local
expert, computes its experts, weights the outputs and sums a row's copies; one row per (token, rank) comes back
and the source sums a token's rows. Every sum runs in a fixed order, with no scatter-add: deterministic.
Under compile the exchange runs eagerly and the experts compile on a row count marked unbacked: the sizes read on
the host never reach a guard, so no routing recompiles (issue 49; tests/test_ep_recompiles.py).

Gradient scale. An expert's gradient gathers every dp×cp rank's tokens: those of its EP group through the
all-to-all's backward, those of the other groups by FSDP2's reduction over efsdp — summed, as every other
gradient is (divide factor 1, parallel/fsdp.py). A mean over efsdp would leave expert gradients ep× off the
dense ones (pytorch #160285 had them 2× off); loom verify compares every expert's gradient with the reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from loom.models.experts import Experts
from loom.models.moe import MoEBlock
from loom.parallel.expert_dispatch import exchange
from loom.topology import Grid, Topology

EP_GROUPS = "experts: one copy of all experts (ep)"
EFSDP_GROUPS = "experts: the ranks holding the same experts (efsdp)"
MESH_DIMS = ("pp", "efsdp", "ep", "tp")


def _arranged(grid: Grid) -> torch.Tensor:
    """The LLM grid's ranks as [pp, efsdp, ep, tp]: dp×cp in grid order (cp fastest), cut into runs of ep."""
    lay = grid.layout
    return grid.ranks.permute(0, 3, 1, 2).reshape(lay.pp, lay.tp, lay.efsdp, lay.ep).permute(0, 2, 3, 1)


def add_expert_groups(topo: Topology) -> None:
    """The ep and efsdp groups of the LLM, when ep > 1; every rank calls it, in one order (new_group is a
    world collective)."""
    grid = topo.grids["language"]
    if grid.layout.ep == 1:
        return
    ranks = _arranged(grid)
    topo.registry.add(EP_GROUPS, [tuple(r.tolist()) for r in ranks.permute(0, 1, 3, 2).reshape(-1, grid.layout.ep)])
    topo.registry.add(EFSDP_GROUPS, [tuple(r.tolist()) for r in ranks.permute(0, 2, 3, 1).reshape(-1,
                                                                                                 grid.layout.efsdp)])


def expert_mesh(grid: Grid, device_type: str) -> DeviceMesh:
    """This rank's [pp, efsdp, ep, tp] mesh over the registry's groups: its "ep" and "efsdp" sub-meshes share
    one root, which FSDP2 needs to shard an expert DTensor again."""
    groups = [grid.group("pp"), grid.registry.named(EFSDP_GROUPS), grid.registry.named(EP_GROUPS), grid.group("tp")]
    return DeviceMesh.from_group(groups, device_type, mesh=_arranged(grid), mesh_dim_names=MESH_DIMS)


def apply_expert_parallel(llm: nn.Module, mesh: DeviceMesh, mp: MixedPrecisionPolicy, reshard: bool) -> None:
    """Every MoE block's experts of `llm` (a DecoderLM or a pipeline stage): split over ep, then FSDP2 over
    efsdp as a unit of its own — before the blocks' FSDP2, which then leaves these weights to it."""
    for block in (m for m in llm.modules() if isinstance(m, MoEBlock)):
        parallelize_module(block.experts, mesh["ep"], ExpertParallel())
        fully_shard(block.experts, mesh=mesh["efsdp"], mp_policy=mp, reshard_after_forward=reshard)


class ExpertParallel(ParallelStyle):
    """The stacked weights as DTensors sharded on dim 0 (whole experts) over the ep mesh, and the experts'
    `exchange` seam set to dispatch → local experts → combine."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Experts):
            raise TypeError(f"ExpertParallel applies to Experts, not {type(module).__name__}")
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])))
        group, size = mesh.get_group(), mesh.size()
        module.exchange = functools.partial(exchange, group, size)
        return module
