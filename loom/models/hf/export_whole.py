"""`loom export` of a model loaded from a whole-model folder (`model.hf`: LLaVA, Qwen2-VL, Qwen2-Audio): one folder of
the same family.

The folder it came from is the template: its config.json (the LLM's vocabulary set to the trained one), its tensor
names (transformers 4's or 5's), the tower tensors LLaVA never reads (the layers after `vision_feature_layer`,
the final norm, SigLIP's head) copied unchanged, its processor and tokenizer files copied; every tensor loom
trained replaced by the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from loom.models.hf.whole import encoder_of, family_of, placeholder_ids
from loom.models.hf.errors import HFError
from loom.models.hf.load import PICKLED_SUFFIXES, HFWeights, read_hf_config
from loom.models.llm import LLMConfig
from loom.models.multimodal import ModelConfig, build_model

# keys a job may change without changing the architecture the folder describes
FREE_KEYS = {"language": ("hf", "vocab_size", *LLMConfig.TRAINING_KEYS), "vision": ("hf",), "audio": ("hf",)}


def export_whole(get, m: ModelConfig, out_dir: str | Path) -> Path:
    """Writes the checkpoint's model (`get(name)`: one whole tensor by its one-process name) as `out_dir`, a
    folder of `model.hf`'s family."""
    source = Path(m.hf)
    if not (source / "config.json").is_file():
        raise HFError(f"model.hf = {m.hf!r} is gone: exporting a whole model copies its config.json and the tower "
                      f"tensors it never reads from there; restore the folder (or pass its new path as "
                      f"--model.hf to the run that saves the checkpoint)")
    hf = read_hf_config(source)
    family = family_of(hf)
    name = encoder_of(family)
    _check_same_architecture(hf, m, str(source))
    with torch.device("meta"):
        model = build_model(m.language, m.vision if name == "vision" else None, m.audio if name == "audio" else None,
                            placeholder_ids(family, hf))
    part = model.encoder(name)
    parts = {"language.": model.language, f"{name}.encoder.": part.encoder, f"{name}.projector.": part.projector,
             f"{name}.tiles.": part.tiles}
    tensors: dict[str, torch.Tensor] = {}
    unread: dict[str, torch.Tensor] = {}
    for prefix, module in ((p, m) for p, m in parts.items() if m is not None):  # tiles: an anyres model's
        grown = ("embed_tokens.weight", "lm_head.weight") if prefix == "language." else ()
        weights = HFWeights(source, module, grown)
        try:
            tensors.update(weights.folder_tensors(lambda n: get(prefix + n)))
            unread.update({h: weights.read_stored(h) for h, why in weights.report.skipped.items()
                           if why == family.NOT_READ})
        finally:
            weights.close()
    dtype = next(iter(tensors.values())).dtype  # the folder in the trained dtype throughout, as config.json says
    tensors.update({h: t.to(dtype) for h, t in unread.items()})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({h: t.detach().contiguous().cpu() for h, t in tensors.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    dtype_name = str(dtype).removeprefix("torch.")
    vocab = {"vocab_size": m.language.vocab_size}
    # the LLM's keys: text_config (LLaVA, transformers 5), or the top level of an older flat Qwen2-VL config.json
    nested = "text_config" in hf or family.FAMILY == "llava"
    config = dict(hf, **({"text_config": {**(hf.get("text_config") or {}), **vocab}} if nested else vocab),
                  dtype=dtype_name, torch_dtype=dtype_name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in source.iterdir():  # the processor's and tokenizer's files
        if path.is_file() and path.name not in ("config.json", "model.safetensors.index.json") and \
                path.suffix not in (".safetensors", *PICKLED_SUFFIXES):
            shutil.copyfile(path, out / path.name)
    return out


def _check_same_architecture(hf: dict, m: ModelConfig, where: str) -> None:
    """The checkpoint's modules are the ones `model.hf`'s config.json describes (but for what training changes)."""
    family = family_of(hf)
    folder = family.configs(hf, where, m.hf)
    for name, want in zip(("language", encoder_of(family)), folder):
        have = getattr(m, name)
        differ = [f"{f.name} = {getattr(have, f.name)!r} (the folder's {getattr(want, f.name)!r})"
                  for f in dataclasses.fields(want)
                  if f.name not in FREE_KEYS[name] and getattr(have, f.name) != getattr(want, f.name)]
        if differ:
            raise HFError(f"the checkpoint's model.{name} is not {where}'s: {', '.join(differ)}")
