"""An embedding tied to the LM head across pipeline stages: two parameters, one gradient.

On one process `lm_head.weight is embed_tokens.weight`. Split into stages, the embedding lives on stage 0 and
the head on the last stage — other ranks, or under zbv another FSDP2 root of the same rank, and one Parameter
cannot belong to two roots — so `split_language` gives the head its own Parameter, a copy of the embedding.
After the schedule each copy holds only its own part of the gradient; `TiedEmbedding.sum_grads` adds the two
parts, so both hold the one-process gradient, and AdamW, given the same gradient from the same start, keeps
the copies bitwise equal.

Both copies are [vocab, hidden] and sharded alike: TP splits vocab rows (Shard(0): the embedding row-wise,
the head column-wise) and FSDP2 then splits dim 0 over the same dp (dp×cp) coordinates, so the local shards of
the stage-0 rank and of the last stage's rank at one (dp, cp, tp) coordinate hold the same rows and add
elementwise: a 2-rank all-reduce per coordinate over a group the registry creates up front, or a local add
when one rank holds both stages (zbv). The head copy counts once in nothing: the grad norm leaves it out
(train/optim.py), verify compares it with the reference's tied weight, checkpoints store the tie once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from loom.config import JobConfig
from loom.parallel.local import local_tensor
from loom.parallel.pipeline import PipelinedLM, stages_of_rank
from loom.topology import Grid, Topology

TIED_PAIRS = "tied embedding: stage 0 ↔ last stage"  # the registry's name for the pair groups


def pair_rank_sets(grid: Grid, schedule: str, virtual: int) -> list[tuple[int, ...]]:
    """For every (dp, cp, tp) coordinate of the LLM grid: the rank holding stage 0 and the rank holding the last
    stage, in rank order; none when one rank holds both (zbv)."""
    pp = grid.layout.pp
    n_stages = pp * virtual
    first, last = (next(r for r in range(pp) if s in stages_of_rank(r, pp, virtual, schedule))
                   for s in (0, n_stages - 1))
    if first == last:
        return []
    return [tuple(sorted(pair)) for pair in zip(grid.ranks[first].flatten().tolist(),
                                                 grid.ranks[last].flatten().tolist())]


def tied_embedding_group(topo: Topology, cfg: JobConfig) -> dist.ProcessGroup | None:
    """Creates the pair groups on every rank (a world collective, in one order) and returns this rank's, or
    None (no tie across stages, one rank holds both copies, or this rank holds neither)."""
    lang = topo.grids["language"]
    if not cfg.model.language.tie_embeddings or lang.layout.pp == 1:
        return None
    topo.registry.add(TIED_PAIRS, pair_rank_sets(lang, cfg.parallel.pp_schedule, cfg.parallel.pp_virtual_stages))
    return topo.registry.named(TIED_PAIRS)


class TiedEmbedding:
    """This rank's copies of the tied weight (the embedding of stage 0, the head copy of the last stage) and
    the group joining a single copy to the other one's rank."""

    def __init__(self, lm: PipelinedLM, group: dist.ProcessGroup | None) -> None:
        self.copies: list[nn.Parameter] = []
        if getattr(lm, "embed_tokens", None) is not None:  # stage 0 is this rank's
            self.copies.append(lm.embed_tokens.weight)
        self.copies += [lm.get_parameter(name) for name in lm.tied_copies]
        if len(self.copies) == 1 and group is None:
            raise RuntimeError("a tied embedding split over stages needs the group joining its two copies' ranks "
                               "(parallel/tied.py tied_embedding_group)")
        self.group = group

    def sum_grads(self) -> None:
        """After the schedule: both copies' gradients become their sum, the one-process gradient."""
        if not self.copies or not self.copies[0].requires_grad:  # a frozen LLM: no gradients on either side
            return
        with torch.no_grad():
            local = [local_tensor(_grad(p)) for p in self.copies]
            if len(local) == 2:  # one rank holds both stages (zbv)
                local[0].add_(local[1])
                local[1].copy_(local[0])
            else:
                dist.all_reduce(local[0], group=self.group)


def _grad(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:  # the other copy's part still counts
        p.grad = torch.zeros_like(p)
    return p.grad




def tied_copy_names(model: nn.Module) -> dict[str, str]:
    """This rank's copies of a weight the one-process model shares, by name → the one-process name: a pipelined
    LLM's head copy of the tied embedding."""
    language = getattr(model, "language", None)
    return {f"language.{k}": f"language.{v}" for k, v in getattr(language, "tied_copies", {}).items()}
