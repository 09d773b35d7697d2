"""Hugging Face interop: load safetensors checkpoints into loom modules, export loom modules back.

    from loom.models.hf import build_pretrained, load_module, export_module, export_checkpoint
    llm = build_pretrained("path/to/Llama-3.2-1B")          # DecoderLM, built on meta, filled per tensor
    export_module(llm, "out/language")                       # LlamaForCausalLM folder

Supported: Llama 3.x / Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE causal LMs, SigLIP vision towers, Whisper encoders
(see mapping.py for what is rejected and why). A job loads a module from a folder with
`model.<module>.hf = "path"`; `loom export CHECKPOINT --hf OUT_DIR` writes a loom checkpoint back.

`transformers` is not needed (nor imported) by this package.
"""

from loom.models.hf.export import export_checkpoint, export_module, write_hf_folder
from loom.models.hf.load import (
    LoadReport,
    build_pretrained,
    checkpoint_index,
    config_from_folder,
    load_module,
    HFWeights,
    read_hf_config,
    resolve_pretrained_configs,
)
from loom.models.hf.mapping import HFError, config_from_hf, config_to_hf

__all__ = [
    "HFError",
    "LoadReport",
    "build_pretrained",
    "checkpoint_index",
    "config_from_folder",
    "config_from_hf",
    "config_to_hf",
    "export_checkpoint",
    "export_module",
    "load_module",
    "HFWeights",
    "read_hf_config",
    "resolve_pretrained_configs",
    "write_hf_folder",
]
