"""Training FLOPs of the work a step actually does on real (non-padding) tokens.

Per module, per token: 6 · (parameters of its matrix multiplies) — forward 2, backward 4 — which counts
every linear layer (the LM head included, the embedding lookup excluded) and the patch / conv stems as the
matmuls they are. Plus attention scores and their weighting, per sample of length L and per layer with
width d = heads · head_dim: forward 4·L²·d bidirectional, 2·L²·d causal (half the pairs); training 3× that.
Padding is never counted: a padded contender pays for its pads in time, and its MFU shows it.
"""

from __future__ import annotations

import torch.nn as nn


def matmul_params(module: nn.Module) -> int:
    """Weights of the module's linear and convolution layers (the multiply-accumulate operands)."""
    n = 0
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            n += m.weight.numel()
    return n


def attention_flops(lengths: list[int], layers: int, width: int, causal: bool) -> float:
    per_pair = 2 if causal else 4
    return 3.0 * per_pair * layers * width * sum(n * n for n in lengths)


def step_flops(llm_params: int, llm_layers: int, llm_width: int, llm_lengths: list[int],
               encoders: list[tuple[int, int, int, list[int]]]) -> float:
    """encoders: (matmul params incl. projector, layers, width, tokens per item) for each encoder."""
    total = 6.0 * llm_params * sum(llm_lengths) + attention_flops(llm_lengths, llm_layers, llm_width, True)
    for params, layers, width, items in encoders:
        total += 6.0 * params * sum(items) + attention_flops(items, layers, width, False)
    return total
