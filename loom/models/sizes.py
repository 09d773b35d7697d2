"""Sizes of a model's parts that cost models read: the FLOP count (train/flops.py) and the balancing of an
encoder's layers over pipeline stages (parallel/encoder_pipeline.py), which sits below train/."""

from __future__ import annotations

import torch.nn as nn

from loom.models.moe import MoEBlock


def matmul_params(module: nn.Module) -> int:
    """Weights of the module's linear and convolution layers (the multiply-accumulate operands); in a
    mixture-of-experts block, its router and its experts at their active share, top_k of E."""
    n = 0
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            n += m.weight.numel()
        elif isinstance(m, MoEBlock):  # the router's [E, hidden] on every token; the experts on top_k of them
            spec = m.gate.spec
            n += m.gate.weight.numel() + sum(p.numel() for p in m.experts.parameters()) * spec.top_k // spec.num_experts
    return n
