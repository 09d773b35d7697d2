"""Writing loom modules back as Hugging Face folders (`config.json` + `model.safetensors`).

- language → LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM (attention_bias → qwen2, qk_norm → qwen3,
  else llama), loadable with `AutoModelForCausalLM.from_pretrained`;
- vision → SiglipVisionModel (without the pooling head: `vision_use_head = false`);
- audio → WhisperEncoder (`WhisperEncoder.from_pretrained`; a full WhisperConfig, encoder weights only).

config.json is written by hand, so exporting needs no transformers. Projectors have no Hugging Face
counterpart and stay in the loom checkpoint only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from loom.models.hf.export_whole import export_whole
from loom.models.hf.load import MODULES, expected_tensors, module_kind
from loom.models.hf.mapping import HFError, config_to_hf
from loom.models.hf.names import EXPORT_PREFIXES, hf_name
from loom.models.hf.stacked import expert_names, is_stacked
from loom.models.multimodal import ModelConfig
from loom.typed_config import ConfigError, from_dict


def export_module(module: nn.Module, out_dir: str | Path) -> Path:
    """Writes a DecoderLM / VisionEncoder / AudioEncoder as a Hugging Face folder."""
    kind = module_kind(module)
    tensors = {n: t for n, t in module.state_dict().items() if n in expected_tensors(module)}
    return write_hf_folder(kind, module.cfg, tensors, out_dir)


def write_hf_folder(kind: str, cfg, tensors: Mapping[str, torch.Tensor], out_dir: str | Path) -> Path:
    """`tensors` are the module's own (module-relative loom names, tied ones once); they must be exactly the
    tensors a module built from `cfg` has, with its shapes."""
    dtype = next(iter(tensors.values())).dtype
    hf = config_to_hf(kind, cfg, dtype)  # first: a config without an HF counterpart is the error to report
    with torch.device("meta"):
        expected = expected_tensors(MODULES[kind](cfg))
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    bad = [f"{n}: {list(tensors[n].shape)} vs {list(expected[n])}" for n in sorted(set(tensors) & set(expected))
           if tuple(tensors[n].shape) != expected[n]]
    if missing or unexpected or bad:
        raise HFError(f"{kind}: tensors do not match the config: missing {missing}; unexpected {unexpected}; "
                      f"shape mismatch {bad}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix, family = EXPORT_PREFIXES[kind], hf["model_type"]
    on_disk = {}
    for n, t in tensors.items():
        if is_stacked(n):  # stacked experts are written one tensor per expert, as Hugging Face stores them
            on_disk.update({hf_name(kind, e, prefix, family): t[i]
                            for i, e in enumerate(expert_names(n, t.shape[0]))})
        else:
            on_disk[hf_name(kind, n, prefix, family)] = t
    save_file({h: t.detach().contiguous().cpu() for h, t in on_disk.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> dict[str, Path | list[str]]:
    """Writes each module of a loom checkpoint folder (a sharded `step-N`; see loom/checkpoint) as
    `out_dir/<module>`, reading one tensor at a time — or, for a model loaded from a whole-model folder
    (`model.hf`), `out_dir` as one folder of that family. Returns the folders and the tensors not exported."""
    from loom.checkpoint.read import CheckpointWeights
    from loom.checkpoint.sharded import CheckpointError

    ckpt = Path(checkpoint)
    try:
        saved = CheckpointWeights(ckpt)
    except CheckpointError as e:
        raise HFError(str(e)) from None
    state = saved.state
    if "model" not in state.get("config", {}):
        raise HFError(f"{ckpt}/state.json has no config.model: the module sizes are unknown")
    try:
        m = from_dict(ModelConfig, state["config"]["model"], "model.")
    except ConfigError as e:
        raise HFError(f"{ckpt}/state.json: {e}") from None
    if m.hf:  # a whole-model folder's family: one folder
        exported = ("language.", *(f"{name}." for name in m.encoders))
        return {"model": export_whole(saved.get, m, out_dir),
                "not_exported": sorted(n for n in saved.names if not n.startswith(exported))}
    modules = {"language": ("language.", m.language)}
    modules.update({name: (f"{name}.encoder.", getattr(m, name)) for name in m.encoders})
    written: dict = {}
    for kind, (prefix, cfg) in modules.items():
        tensors = {n[len(prefix):]: saved.get(n) for n in saved.names if n.startswith(prefix)}
        written[kind] = write_hf_folder(kind, cfg, tensors, Path(out_dir) / kind)
    exported = tuple(prefix for prefix, _ in modules.values())
    written["not_exported"] = sorted(n for n in saved.names if not n.startswith(exported))
    return written
