"""torch.compile per transformer block (`train.compile = true`).

Each block's `forward` is compiled in place of the module: the module stays what it was (same parameter
names for checkpoints and Hugging Face export), and the hooks that FSDP2 and TP install on it run eagerly
around the compiled body. Blocks of one module share their code, so one graph serves them all.

Fixed shapes: with a token budget (`data.tokens_per_microbatch = T`) nothing a compiled block sees changes
between microbatches, so after the first step nothing compiles again. The LLM's microbatches are T tokens
with `cu_seqlens` of a fixed length and max_seqlen = T (train/inputs.py `collate`); each encoder pads its
layers' rows to a fixed `RowBudget` (models/encoder_layer.py `run_packed`), set here. Without a budget,
token counts are rounded up to 64 and the guards that remain (alignment, size ranges) see few variants.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import torch
import torch._functorch.config
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters

from loom.config import JobConfig, TrainConfig
from loom.models.encoder_layer import GRAPH_ROW_BUCKETS, ROW_MULTIPLE, RowBudget
from loom.parallel.blocks import transformer_blocks
from loom.topology.layout import resolve_placement

# every block of a module is a separate frame for dynamo's cache; leave room for the encoders' and the
# LLM's static + dynamic variants
_CACHE_LIMIT = 64


def compile_blocks(name: str, module: nn.Module, cfg: JobConfig | None = None) -> None:
    """Compiles every transformer block of module `name` in place, with `train.compile_backend` (inductor
    without a config); an encoder also gets its row budget."""
    backend = cfg.train.compile_backend if cfg else "inductor"
    use_compile_caches(cfg)
    config = torch._dynamo.config
    key = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # renamed in 2.x
    setattr(config, key, max(getattr(config, key), _CACHE_LIMIT))
    budgets = row_budgets(cfg, dist.get_world_size() if dist.is_initialized() else 1) if cfg else {}
    if name in budgets:
        module.encoder.row_budget = budgets[name]
    # CUDA graphs: the LLM's blocks once, an encoder's once per row count it meets (its rows rounded coarsely)
    mode = cfg.train.compile_mode if cfg and cfg.train.compile_mode != "default" else None
    if mode == "reduce-overhead":  # the step marks graph trees once they are loaded (train/step.py): from step 0
        importlib.import_module("torch._inductor.cudagraph_trees")
    dynamic = encoder_dynamic(name in budgets, mode)
    for block in transformer_blocks(name, module):
        # the forward, not the module (module.compile() traces FSDP2's and TP's hooks; torch.compile(block) renames
        # its parameters): kept in plain sight by the module docstring and tests/test_recompiles.py
        block.forward = torch.compile(block.forward, backend=backend, dynamic=dynamic, mode=mode)


def use_compile_caches(cfg: JobConfig | None) -> None:
    """Compiled code kept on disk across starts: inductor's kernels (its FX graph cache, on by default) and
    AOTAutograd's traced graphs, in `train.compile_cache_dir` when set (else inductor's default directory), so a
    later start of the job compiles nothing anew and no rank's slow compile stalls the others. AOTAutograd's cache
    stays off where a module's weights are DTensors inside its blocks (TP, EP): a compiled TP + SP block restored
    from it gave wrong gradients on torch 2.13 while a fresh compile was exact (tests/test_compile_cache.py)."""
    if cfg is not None and cfg.train.compile_cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cfg.train.compile_cache_dir).resolve())
    layouts = [getattr(cfg.layout, n) for n in ("language", *cfg.model.encoders)] if cfg is not None else []
    split = cfg is None or any(lay is not None and (lay.tp > 1 or lay.ep > 1) for lay in layouts)
    torch._functorch.config.enable_autograd_cache = not split


def row_budgets(cfg: JobConfig, world_size: int) -> dict[str, RowBudget]:
    """Each encoder's fixed rows per call: `data.encoder_rows_per_microbatch[name]`, else the tokens (T, or
    R·S padded) per LLM microbatch it serves (its rows are placeholders among those tokens, so they always
    suffice); items: one per sample of the global batch."""
    t, explicit = cfg.data.tokens_per_microbatch, cfg.data.encoder_rows_per_microbatch
    layouts = resolve_placement(cfg, world_size).layouts
    llm_dp = layouts["language"].dp
    # fan-out: an encoder replica serves several LLM replicas (LLM microbatches one encoder call covers)
    serves = {n: max(1, llm_dp // layouts[n].dp) for n in cfg.model.encoders}
    # padded (bshd): a microbatch is [R, S], R = global_batch_size / (dp·M)
    t = t or cfg.data.padded_length * (cfg.train.global_batch_size // (llm_dp * cfg.train.microbatches))
    rows = {n: explicit.get(n) or t * serves[n] for n in serves}
    # an encoder under sequence parallel splits its rows over tp (a divisor of ROW_MULTIPLE): whole multiples
    sp = {n for n in serves if layouts[n].sequence_parallel}
    rows = {n: -(-r // ROW_MULTIPLE) * ROW_MULTIPLE if n in sp else r for n, r in rows.items()}
    graphs = cfg.train.compile_mode == "reduce-overhead"
    return {n: RowBudget(r, cfg.train.global_batch_size, graph_multiple(r) if graphs else ROW_MULTIPLE)
            for n, r in rows.items() if r}


def encoder_dynamic(encoder: bool, mode: str | None) -> bool | None:
    """How a block's row count is traced. An encoder's rows follow the data (rounded to ROW_MULTIPLE, not
    padded to the budget): traced symbolically from the first call (resumed frames after a graph break too),
    so no row count recompiles. Under CUDA graphs its rows fall in at most GRAPH_ROW_BUCKETS counts, each
    captured anyway: there they are static, one compile per count met, because inductor's reductions over a
    symbolic row count (LayerNorm's weight and bias gradients, the linears' bias gradients) were the ViT's
    slow kernels (bench/RESULTS.md, round 6). False, not None: None would turn the second count symbolic."""
    if not encoder:
        return None
    return mode != "reduce-overhead"


def graph_multiple(rows: int) -> int:
    """What CUDA-graphed encoder rows are rounded up to: a quarter of the budget, in whole ROW_MULTIPLEs."""
    return -(-rows // (GRAPH_ROW_BUCKETS * ROW_MULTIPLE)) * ROW_MULTIPLE


def compile_backend(train: TrainConfig) -> str | None:
    """The backend the step's compiled functions (the loss) use: None when the job does not compile."""
    return train.compile_backend if train.compile else None


def compiled_frames() -> int:
    """Frames dynamo has compiled in this process, first compiles and recompiles alike: what this returns
    after a run's first step, subtracted from what it returns later, is the run's recompiles."""
    return counters["frames"]["total"]
