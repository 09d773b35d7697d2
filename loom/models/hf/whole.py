"""The families of whole-model folders (`[model] hf`): config.json's model_type picks one. Each family module names
its parts' configs and where their tensors sit, with one interface (llava.py, llava_onevision.py, qwen2_vl.py)."""

from __future__ import annotations

from types import ModuleType

from loom.models.hf import llava, llava_onevision, qwen2_vl

FAMILIES = (llava, llava_onevision, qwen2_vl)


def family_of(hf: dict) -> ModuleType | None:
    """The family module of a whole-model config.json, None for a folder of one module."""
    return next((f for f in FAMILIES if f.is_whole_model(hf)), None)


def names() -> list[str]:
    return [f.FAMILY for f in FAMILIES]
