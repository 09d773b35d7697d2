"""The experts' load, once per optimizer step: DeepSeek-V3's auxiliary-loss-free bias update and the load
metrics.

Each MoE block counted the tokens each expert received over the step's microbatches (models/moe.py). Summed
over the LLM's dp×cp ranks, those are the global batch's counts: the same for any layout and any number of
microbatches (tp ranks count the same tokens, and a pipeline stage sums only its own layers). The bias of a
router with `router_bias_update_rate` γ > 0 then moves by γ·sign(mean − count): up for an underloaded expert,
down for an overloaded one. A skipped step (non-finite gradients) moves no bias; the counts are cleared
either way. Each sparse layer's max / mean load goes to metrics.jsonl as `expert_load/<layer>`, gathered over
the world so rank 0 reports every stage's layers; `keep_totals()` also sums every later step's counts on the
device (bench/mm_bench.py reads them once, after its timed steps).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from loom.models.llm import LLMConfig
from loom.models.moe import MoEBlock

_LAYER = re.compile(r"layers\.(\d+)\.mlp$")


@dataclass
class ExpertLoad:
    layers: tuple[int, ...]  # the LLM's sparse layers (all stages)
    num_experts: int
    rate: float  # router_bias_update_rate
    group: dist.ProcessGroup | None = None  # the LLM's dp×cp group on an LLM rank; None: nothing to sum over
    world: bool = False  # gather every layer's load over the world (every rank calls `finish`, in one order)

    # the counts summed over every step since `keep_totals()`, [layer, expert] in fp64 on the device: a reader
    # (bench/mm_bench.py) takes them once at the end, so the steps gain no host read
    totals: torch.Tensor | None = None
    keeping: bool = False

    def keep_totals(self) -> None:
        """From the next step on, sum each step's counts into `totals` (from zero)."""
        self.keeping, self.totals = True, None

    def finish(self, model: nn.Module, applied: bool) -> dict[str, float]:
        """After the optimizer step (`applied`: it was not skipped): the bias update and the step's load metrics."""
        blocks = hosted_blocks(model)
        counts = torch.zeros(len(self.layers), self.num_experts, device=_device(model))
        if blocks:
            mine = torch.stack([b.tokens_per_expert for b in blocks.values()])
            if self.group is not None:
                dist.all_reduce(mine, group=self.group)
            if applied and self.rate:
                with torch.no_grad():
                    for b, c in zip(blocks.values(), mine):
                        b.gate.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
            for b in blocks.values():
                b.tokens_per_expert.zero_()
            rows = [self.layers.index(i) for i in blocks]
            counts[rows] = mine.to(counts.device)
        if self.world:
            # each layer's summed counts are equal on every rank holding it and zero elsewhere
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        if self.keeping:
            self.totals = counts.double() if self.totals is None else self.totals + counts
        return {f"expert_load/{layer}": _imbalance(c) for layer, c in zip(self.layers, counts.cpu())}


def hosted_blocks(model: nn.Module) -> dict[int, MoEBlock]:
    """This rank's MoE blocks by layer index, in layer order."""
    found = {int(_LAYER.search(n).group(1)): m for n, m in model.named_modules() if isinstance(m, MoEBlock)}
    return dict(sorted(found.items()))


def _imbalance(counts: torch.Tensor) -> float:
    mean = counts.float().mean()
    return float(counts.max() / mean) if mean > 0 else 0.0


def _device(model: nn.Module) -> torch.device:
    return next(iter(model.parameters()), torch.empty(0)).device


def expert_load(lm: LLMConfig, group: dist.ProcessGroup | None = None, world: bool = False) -> ExpertLoad | None:
    """The per-step load work of an LLM with experts (None for a dense one)."""
    if not lm.num_experts:
        return None
    return ExpertLoad(tuple(lm.sparse_layers), lm.num_experts, lm.router_bias_update_rate, group, world)
