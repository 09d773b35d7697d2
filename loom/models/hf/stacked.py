"""Stacked experts ↔ Hugging Face's per-expert tensors.

loom keeps a sparse layer's routed experts as three [E, …] tensors (`layers.N.mlp.experts.gate_proj`, ...);
a Qwen3-MoE / DeepSeek-V3 folder stores one tensor per expert and projection
(`layers.N.mlp.experts.e.gate_proj.weight`), the slice e of loom's tensor exactly. transformers 5 fuses the
experts in memory (`experts.gate_up_proj` [E, 2I, D]) but writes the per-expert names on `save_pretrained`:
the folder on disk, not transformers' module, is what these names describe.
"""

from __future__ import annotations

import re

_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")


def is_stacked(name: str) -> bool:
    return _STACKED.match(name) is not None


def expert_names(name: str, count: int) -> list[str]:
    """The module-relative per-expert names of stacked tensor `name` with `count` experts, in expert order."""
    owner, proj = _STACKED.match(name).groups()
    return [f"{owner}.{e}.{proj}.weight" for e in range(count)]
