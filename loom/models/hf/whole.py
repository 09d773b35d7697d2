"""The families of whole-model folders (`[model] hf`): config.json's model_type picks one. Each family module names
its parts' configs and where their tensors sit, with one interface (llava.py, llava_onevision.py, qwen2_vl.py,
qwen2_audio.py); `ENCODER` is the loom module its tower and projector make (vision, or Qwen2-Audio's audio)."""

from __future__ import annotations

from types import ModuleType

from loom.models.hf import llava, llava_onevision, qwen2_audio, qwen2_vl

FAMILIES = (llava, llava_onevision, qwen2_vl, qwen2_audio)


def family_of(hf: dict) -> ModuleType | None:
    """The family module of a whole-model config.json, None for a folder of one module."""
    return next((f for f in FAMILIES if f.is_whole_model(hf)), None)


def encoder_of(family: ModuleType) -> str:
    return getattr(family, "ENCODER", "vision")


def placeholder_ids(family: ModuleType, hf: dict) -> dict[str, int]:
    """The encoder module → the id of its placeholder token in the folder's config.json."""
    if encoder_of(family) == "audio":
        return {"audio": family.audio_token(hf)}
    return {"vision": family.image_token(hf)}


def names() -> list[str]:
    return [f.FAMILY for f in FAMILIES]
