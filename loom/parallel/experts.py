"""Expert parallelism (`[layout.language] ep = N`): each sparse layer's experts split over N ranks, applied
from outside to the MoE blocks' `experts` seam.

Which ranks. EP is a second view of the LLM's dp×cp ranks (per pp stage and tp coordinate): in dp×cp order,
each run of `ep` consecutive ranks is one EP group and holds one copy of all experts, rank j of it experts
j·E/ep … (j+1)·E/ep − 1; the dp×cp/ep ranks at the same place of each run ("efsdp") hold the same experts and
FSDP2 shards them over those. tp ranks stay out of it: they hold the same tokens (gathered under SP), so each
tp coordinate runs its own EP groups and its experts are replicated over tp like the router and the norms.

How tokens travel. The MoE block has sorted its tokens by (global) expert; here the per-expert counts go to
every rank of the EP group (an even all-to-all), then the tokens by an uneven all-to-all (autograd: its
backward is the reverse all-to-all), are computed in (local expert, source) order — each row's place there
computed from the counts, and the grouped kernel moves rows straight to it — and sent home in arrival order.
Nothing depends on arrival timing: deterministic. With `parallel.ep_chunks` > 1 the block's tokens come in chunks,
each exchanged by async all-to-alls that overlap the experts' compute of the others (parallel/expert_chunks.py).
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
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from loom.models.experts import Experts
from loom.models.moe import MoEBlock
from loom.parallel.expert_chunks import arrival_places, chunked_exchange, chunked_exchange_eagerly
from loom.parallel.fsdp_chunks import chunk_lazily
from loom.parallel.local import local_tensor
from loom.topology import Grid, Topology

EP_GROUPS = "experts: one copy of all experts (ep)"
EFSDP_GROUPS = "experts: the ranks holding the same experts (efsdp)"
MESH_DIMS = ("pp", "efsdp", "ep", "tp")
# the experts' fully_shard over efsdp, as parallel/fsdp.py's: only the chunks FSDP2 reads (parallel/fsdp_chunks.py)
chunk_lazily()


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


def apply_expert_parallel(llm: nn.Module, mesh: DeviceMesh, mp: MixedPrecisionPolicy, reshard: bool,
                          chunks: int = 1) -> None:
    """Every MoE block's experts of `llm` (a DecoderLM or a pipeline stage): split over ep, then FSDP2 over
    efsdp as a unit of its own — before the blocks' FSDP2, which then leaves these weights to it. `chunks`
    (parallel.ep_chunks): each layer's exchange cut into that many overlapped ones (parallel/expert_chunks.py)."""
    for block in (m for m in llm.modules() if isinstance(m, MoEBlock)):
        parallelize_module(block.experts, mesh["ep"], ExpertParallel(chunks))
        fully_shard(block.experts, mesh=mesh["efsdp"], mp_policy=mp, reshard_after_forward=reshard)


class ExpertParallel(ParallelStyle):
    """The stacked weights as DTensors sharded on dim 0 (whole experts) over the ep mesh, and the experts'
    `exchange` seam set to dispatch → local experts → combine (in `chunks` overlapped pieces when > 1)."""

    def __init__(self, chunks: int = 1) -> None:
        super().__init__()
        self.chunks = chunks

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Experts):
            raise TypeError(f"ExpertParallel applies to Experts, not {type(module).__name__}")
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])))
        group, size = mesh.get_group(), mesh.size()
        module.exchange = functools.partial(_dispatch_compute_combine, group, size)
        module.chunks = self.chunks
        return module


def _dispatch_compute_combine(group: dist.ProcessGroup, ep: int, experts: Experts, x: torch.Tensor,
                              counts: torch.Tensor) -> torch.Tensor:
    """`x` [n, hidden] sorted by global expert, `counts` [E]: the experts' outputs in `x`'s order. Under compile
    the two exchanges run eagerly and the experts compiled on a row count dynamo treats as unbacked (below).
    `counts` [chunks, E] (`experts.chunks` > 1): `x` in chunks, exchanged overlapped (parallel/expert_chunks.py)."""
    if counts.dim() == 2:
        if experts.use_grouped(x):
            return chunked_exchange(group, ep, experts, x, counts, True)
        return chunked_exchange_eagerly(group, ep, experts, x, counts, False)
    if not experts.use_grouped(x):  # the per-expert loop reads its counts on the host: all of it eager
        return _exchange_eagerly(group, ep, experts, x, counts)
    return _exchange(group, ep, experts, x, counts)


def _exchange(group: dist.ProcessGroup, ep: int, experts: Experts, x: torch.Tensor,
              counts: torch.Tensor) -> torch.Tensor:
    arrived, received, back, splits = _dispatch(group, ep, x, counts)
    local = counts.numel() // ep
    y = experts.compute(arrived, received.view(ep, local).sum(0),
                        *(local_tensor(p) for p in (experts.gate_proj, experts.up_proj, experts.down_proj)), back=back)
    return _combine(group, y, splits)


_exchange_eagerly = torch.compiler.disable(_exchange)


@torch.compiler.disable  # split sizes from the host: as ints in a compiled frame every step's values were guards
def _dispatch(group: dist.ProcessGroup, ep: int, x: torch.Tensor,
              counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens this rank's experts compute, in arrival order; `received` [ep · local] (what each source sends
    each of my experts), each arrived row's place in expert order and the split sizes (a host tensor
    [send, recv] × ep)."""
    local = counts.numel() // ep
    received = torch.empty_like(counts)  # [source rank, local expert]: what each EP rank sends to mine
    dist.all_to_all_single(received, counts, group=group)
    # the host needs the split sizes: both directions in one read (the grouped kernel reads nothing more)
    splits = torch.stack([counts, received]).view(2, ep, local).sum(2).cpu()
    send, recv = splits.tolist()
    arrived = _AllToAll.apply(x, recv, send, group)
    return (*arrival_places(arrived, received, ep, recv, x.shape[0]), splits)


@torch.compiler.disable
def _combine(group: dist.ProcessGroup, y: torch.Tensor, splits: torch.Tensor) -> torch.Tensor:
    """The experts' outputs (in arrival order) home to their source ranks."""
    send, recv = splits.tolist()  # a host tensor: no device sync
    # without the zero row _dispatch puts in when nothing arrived
    return _AllToAll.apply(y.narrow(0, 0, sum(recv)), send, recv, group)


class _AllToAll(torch.autograd.Function):
    """An uneven all-to-all whose backward is the reverse one; eager and a plain tensor out (functional
    collectives hand back an AsyncCollectiveTensor, a subclass `mark_unbacked` refuses)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.sizes, ctx.group = (recv, send), group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        recv, send = ctx.sizes
        return _AllToAll.apply(grad, send, recv, ctx.group), None, None, None
