"""torch.compile per transformer block (`train.compile = true`).

Each block's `forward` is compiled in place of the module: the module stays what it was (same parameter
names for checkpoints and Hugging Face export), and the hooks that FSDP2 and TP install on it run eagerly
around the compiled body. Blocks of one module share their code, so one graph serves them all. The token
count changes every step: the second step recompiles with dynamic sizes, and the guards that remain
(alignment, size ranges) see few variants because token counts are rounded up to 64 (train/build.py
`collate`, models/encoder_layer.py `run_packed`).
"""

from __future__ import annotations

import torch
import torch._functorch.config
import torch.nn as nn

from loom.parallel.blocks import transformer_blocks

# every block of a module is a separate frame for dynamo's cache; leave room for the encoders' and the
# LLM's static + dynamic variants
_CACHE_LIMIT = 64


def compile_blocks(model: nn.Module, modules: list[str], backend: str = "inductor") -> None:
    # A compiled TP + SP block restored from AOTAutograd's on-disk cache (a second run of the same job)
    # gave wrong gradients on torch 2.13 while a fresh compile was exact (tests/test_compile_cache.py).
    # Off, every run traces its graphs again; inductor's kernel cache still spares the codegen.
    torch._functorch.config.enable_autograd_cache = False
    config = torch._dynamo.config
    key = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # renamed in 2.x
    setattr(config, key, max(getattr(config, key), _CACHE_LIMIT))
    for name in modules:
        for block in transformer_blocks(name, model.get_submodule(name)):
            block.forward = torch.compile(block.forward, backend=backend)
