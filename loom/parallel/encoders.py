"""The encoders' parallelize recipe (vision, audio: a ModalityEncoder each): its blocks compiled and
checkpointed on every run, then, under a layout, its pipeline split (non-colocated only), TP/SP and FSDP2 (or,
with `fsdp = false`, replicas: parallel/replicate.py), read from the encoder's own Grid.

Why this order (as for the LLM, language.py): compile and activation checkpointing each replace a block's
`forward` in place, compile first, so the compiled body runs inside the checkpoint; compile also fixes the
encoder's rows per call (its `RowBudget`). The hooks TP and FSDP2 add then run around the checkpointed body,
FSDP2's pre-backward hook re-gathering a block's weights before its recomputation; TP comes before FSDP2,
which shards the DTensors TP made (both meshes share the grid's root). The pipeline split comes before TP and
FSDP2 because they wrap this rank's stage (parallel/encoder_pipeline.py), as for the LLM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
import torch.nn as nn

from loom.config import JobConfig
from loom.parallel.blocks import transformer_blocks
from loom.parallel.checkpointing import checkpoint_blocks
from loom.parallel.compile import compile_blocks
from loom.parallel.encoder_pipeline import encoder_stage
from loom.parallel import fsdp
from loom.parallel.fsdp import apply_fsdp, mixed_precision
from loom.parallel.replicate import replica_group, replicate
from loom.parallel.tensor import apply_encoder_tp
from loom.topology import Grid


def parallelize_encoder(name: str, encoder: nn.Module, grid: Grid | None, cfg: JobConfig, device_type: str,
                        compile_fn: Callable = compile_blocks) -> nn.Module:
    """Encoder `name` laid out on `grid` (None: one process, no layout); returns what takes its place in the
    model: the encoder itself, or under pp this rank's `EncoderStage`."""
    train, par = cfg.train, cfg.parallel
    # in-place swaps first (compile, then AC around it) so the TP and FSDP2 hooks wrap them;
    # FSDP2 last: it shards TP's DTensors
    if train.compile:
        compile_fn(name, encoder, cfg)
    checkpoint_blocks(name, encoder, train.activation_checkpointing, train.compile)
    if grid is None:
        return encoder
    lay = grid.layout
    if lay.pp > 1:
        encoder = encoder_stage(encoder, grid.coord(dist.get_rank())["pp"], lay.pp)
    if lay.tp > 1:
        apply_encoder_tp(encoder, fsdp.tp_mesh(grid, device_type), lay.sequence_parallel)
    if not lay.fsdp:  # whole weights on each dp rank: its gradients summed once a step
        replicate(encoder, replica_group(grid), device_type, train.dtype)
        return encoder
    # fsdp.fsdp_mesh, read when called: bench/cp_long.py swaps it for an HSDP mesh
    blocks = transformer_blocks(name, encoder)
    apply_fsdp(encoder, blocks, fsdp.fsdp_mesh(grid, device_type), mixed_precision(train.dtype, par.reduce_dtype),
               par.reshard_after_forward, fsdp.blocks_per_unit(name, len(blocks), par), par.fsdp_prefetch)
    return encoder
