"""The LLM's parallelize recipe: its blocks compiled and checkpointed on every run, then, under a layout, its
pipeline split, TP/SP and FSDP2 (or, with `fsdp = false`, replicas: parallel/replicate.py), all read from the
LLM's Grid.

Why this order. Compile and activation checkpointing each replace a block's `forward` in place, compile first:
the compiled body runs inside the checkpoint, so the recomputation calls the same graphs, and it is traced
only at the first step, so it sees the layout applied after it. The hooks TP and FSDP2 add then run around
the checkpointed body, and FSDP2's pre-backward hook re-gathers a block's weights before its recomputation.
The pipeline split comes before TP and FSDP2 because they wrap each stage this rank holds (one FSDP2 root per
stage); TP comes before FSDP2, which shards the DTensors TP made (both meshes share the grid's root).

Expert parallelism (ep > 1) comes after TP and before FSDP2: each MoE block's experts are split over ep and
made an FSDP2 unit over efsdp (parallel/experts.py) before the block's unit, which then leaves them alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
import torch.nn as nn

from loom.config import JobConfig
from loom.parallel.blocks import transformer_blocks
from loom.parallel.checkpointing import checkpoint_blocks
from loom.parallel.compile import compile_blocks
from loom.parallel.experts import apply_expert_parallel, expert_mesh
from loom.parallel import fsdp
from loom.parallel.fsdp import apply_fsdp, mixed_precision
from loom.parallel.pipeline import ZERO_BUBBLE, split_language
from loom.parallel.replicate import replica_group, replicate
from loom.parallel.tensor import apply_llm_tp
from loom.topology import Grid


def parallelize_language(name: str, llm: nn.Module, grid: Grid | None, cfg: JobConfig, device_type: str,
                         compile_fn: Callable = compile_blocks) -> nn.Module:
    """`llm` laid out on `grid` (None: one process, no layout). Returns what takes its place in the model:
    `llm` itself, or under pp this rank's `PipelinedLM` (its stages, under the DecoderLM's names)."""
    train, par = cfg.train, cfg.parallel
    # in-place swaps first (compile, then AC around it) so TP/FSDP2 hooks wrap them;
    # the PP split before TP/FSDP2: they wrap each stage
    if train.compile:
        compile_fn(name, llm, cfg)
    checkpoint_blocks(name, llm, train.activation_checkpointing, train.compile)
    if grid is None:
        return llm
    lay = grid.layout
    if lay.pp > 1:
        llm = split_language(llm, grid.coord(dist.get_rank())["pp"], lay.pp, par.pp_virtual_stages, par.pp_schedule,
                             par.pp_split)
    # zero-bubble's deferred weight pass differentiates w.r.t. the parameters registered at that time:
    # resharded blocks would register the sharded ones, which the graph never saw (no gradient)
    reshard = par.reshard_after_forward and not (lay.pp > 1 and par.pp_schedule in ZERO_BUBBLE)
    for part in llm.stages if lay.pp > 1 else [llm]:
        if lay.tp > 1:
            apply_llm_tp(part, fsdp.tp_mesh(grid, device_type), lay.sequence_parallel,
                         seq_dim=0 if cfg.data.format == "thd" else 1)
        # experts split over ep and sharded over efsdp before the blocks' FSDP2, which then skips their weights
        if lay.ep > 1:
            apply_expert_parallel(part, expert_mesh(grid, device_type), mixed_precision(train.dtype, par.reduce_dtype),
                                  reshard, par.ep_chunks)
        if not lay.fsdp:  # whole weights on each dp·cp rank: its gradients summed once a step
            replicate(part, replica_group(grid), device_type, train.dtype)
            continue
        # fsdp.fsdp_mesh, read when called: bench/cp_long.py swaps it for an HSDP mesh
        blocks = transformer_blocks(name, part)
        apply_fsdp(part, blocks, fsdp.fsdp_mesh(grid, device_type), mixed_precision(train.dtype, par.reduce_dtype),
                   reshard, fsdp.blocks_per_unit(name, len(blocks), par), par.fsdp_prefetch)
    return llm
