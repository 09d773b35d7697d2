"""The transformer blocks of each module: the units FSDP gathers one at a time and torch.compile traces."""

from __future__ import annotations

import torch.nn as nn


def transformer_blocks(name: str, module: nn.Module) -> list[nn.Module]:
    if name == "language":
        return list(module.layers.values())
    layers = module.encoder.layers  # a ModuleList, or a pipeline stage's ModuleDict (one-process names as keys)
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
