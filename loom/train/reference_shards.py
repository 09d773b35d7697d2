"""A layout tensor's part on this rank beside the same part of the reference's whole tensor, for `loom verify`.

Every rank holds the whole one-process reference, so the reference is cut here the way the layout's tensor is
sharded (`local_part`'s box, as materialize and resync cut it) and the comparison needs no gather: one
collective per step for a module's sums instead of one per parameter. A shard replicated along a mesh dim
(TP-replicated norms, say) is compared on every copy, but counted in sums once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from loom.parallel.materialize import local_part

if TYPE_CHECKING:
    from loom.train.optim import GradNormShare


@dataclass
class ShardPair:
    mine: torch.Tensor  # this rank's part of the layout's tensor (a plain tensor)
    reference: torch.Tensor  # the same elements of the reference's tensor
    counted: bool  # this copy adds to sums: one copy of each element over the world


def reporting_ranks(share: GradNormShare | None) -> dict[str, frozenset[int]] | None:
    """Per module, the ranks that report it: one per pipeline stage (dp = cp = tp = 0); None on one process."""
    if share is None:
        return None
    everyone: list[frozenset[str]] = [frozenset() for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, share.adds)
    return {m: frozenset(r for r, adds in enumerate(everyone) if m in adds) for m in share.modules}


def shard_pair(layout: torch.Tensor, reference: torch.Tensor, reporters: frozenset[int] | None) -> ShardPair:
    """`layout`'s local part and the matching part of the whole `reference`. The copy counted in sums is the
    one whose mesh holds the module stage's reporting rank (other meshes are replicas: dp copies of a
    TP-only weight, tp copies of an FSDP-only norm), and in it the first along every mesh dim that
    replicates the tensor; `reporters` None: one process, everything counted."""
    if not isinstance(layout, DTensor):
        return ShardPair(layout.detach(), reference.detach(), reporters is None or dist.get_rank() in reporters)
    if any(p.is_partial() for p in layout.placements):  # a pending sum (a gradient not yet reduced): take it
        layout = layout.redistribute(placements=[Replicate() if p.is_partial() else p for p in layout.placements])
    mine, box = local_part(layout.detach())  # the box materialize and resync fill: the same cut
    mesh = layout.device_mesh
    reporting_mesh = reporters is None or not reporters.isdisjoint(mesh.mesh.flatten().tolist())
    first = all(mesh.get_local_rank(d) == 0 for d, p in enumerate(layout.placements) if p.is_replicate())
    return ShardPair(mine, reference.detach()[box], reporting_mesh and first)


def held(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter this rank holds, copied as held (a DTensor stays sharded: no collective)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def held_difference(after: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """after − before, as held. A module FSDP2 left unsharded after its forward (a frozen one: FSDP2 reshards
    in backward) holds a whole tensor on one side: it is cut like the other side's shard first."""
    if isinstance(after, DTensor) != isinstance(before, DTensor):
        like = after if isinstance(after, DTensor) else before
        box = local_part(like)[1]
        after, before = (t if isinstance(t, DTensor) else
                         DTensor.from_local(t[box], like.device_mesh, like.placements, run_check=False,
                                            shape=like.shape, stride=like.stride())
                         for t in (after, before))
    return after - before
