"""The Qwen2-VL family (`model_type = "qwen2_vl"`): where each loom module's tensors sit in its folder.

The tower's `blocks.N` are loom's `layers.N`; the merger's norm belongs to the tower (it normalises each patch
before the 2×2 groups are joined) and its MLP (`merger.mlp.0` / `.2`) is the vision module's projector.
"""

from __future__ import annotations

import re

FAMILY = "qwen2_vl"
# the tower's prefix: transformers 5's save_pretrained first, then transformers 4's
TOWER_PREFIXES = ("model.visual.", "visual.")
_TOWER_NAMES = (
    (r"^blocks\.(\d+)\.", r"encoder.layers.\1."),
    (r"^patch_embed\.", "encoder.patch_embed."),
    (r"^merger\.ln_q\.", "encoder.ln_q."),
    (r"^merger\.mlp\.0\.", "projector.linear_1."),
    (r"^merger\.mlp\.2\.", "projector.linear_2."),
)


def tower_name(name: str) -> str | None:
    """The loom name (in the vision ModalityEncoder: `encoder.…` or `projector.…`) of a folder's tower tensor, or
    None when `name` is not one."""
    prefix = next((p for p in TOWER_PREFIXES if name.startswith(p)), None)
    if prefix is None:
        return None
    rest = name[len(prefix):]
    for pattern, target in _TOWER_NAMES:
        if re.match(pattern, rest):
            return re.sub(pattern, target, rest)
    return None
