"""Applies each module's layout to the model from outside: tensor/sequence parallel first, then FSDP2.

Before this, on every run (one process too), train/build.py `setup_parallel` compiles each block's forward
(compile.py) and wraps it in activation checkpointing (checkpointing.py); both replace `forward` in place,
so the TP and FSDP2 hooks added here run around the checkpointed (compiled) body, and FSDP2 re-gathers a
block's weights before its recomputation in backward.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from loom.config import JobConfig
from loom.models.multimodal import MultimodalModel
from loom.parallel.blocks import transformer_blocks
from loom.parallel.fsdp import apply_fsdp, mixed_precision
from loom.parallel.pipeline import ZERO_BUBBLE, split_language
from loom.parallel.tensor import apply_encoder_tp, apply_llm_tp
from loom.topology import Grid, Topology


def parallelize(model: MultimodalModel, topo: Topology, cfg: JobConfig, device_type: str) -> None:
    """Every module this rank hosts gets its own layout's PP split (the LLM: `model.language` becomes this
    rank's `PipelinedLM`), TP (on the grid's tp mesh) and FSDP (`fsdp_mesh`: dp, or dp×cp flattened)."""
    me = topo.role()
    mp = mixed_precision(cfg.train.dtype)
    for name in (*model.encoder_names, "language"):
        if not me.hosts(name):
            continue
        grid, module = topo.grids[name], model.get_submodule(name)
        lay = grid.layout
        parts = [module]  # what TP and FSDP wrap: the module, or each of its pipeline stages
        reshard = cfg.parallel.reshard_after_forward
        if name == "language" and lay.pp > 1:
            par = cfg.parallel
            model.language = split_language(module, grid.coord(me.rank)["pp"], lay.pp, par.pp_virtual_stages,
                                            par.pp_schedule, par.pp_split)
            parts = model.language.stages
            # zero-bubble's deferred weight pass differentiates w.r.t. the parameters registered at that time:
            # resharded blocks would register the sharded ones, which the graph never saw (no gradient)
            reshard = reshard and par.pp_schedule not in ZERO_BUBBLE
        for part in parts:
            if lay.tp > 1:
                tp_mesh = grid.mesh("tp", device_type=device_type)
                if name == "language":
                    apply_llm_tp(part, tp_mesh, lay.sequence_parallel, seq_dim=0 if cfg.data.format == "thd" else 1)
                else:
                    apply_encoder_tp(part, tp_mesh, lay.sequence_parallel)
            apply_fsdp(part, transformer_blocks(name, part), fsdp_mesh(grid, device_type), mp, reshard,
                       cfg.parallel.blocks_per_unit)


def fsdp_mesh(grid: Grid, device_type: str) -> DeviceMesh:
    """What FSDP2 shards a module over: its dp ranks, or under cp its dp × cp ranks as one flattened dim, so
    parameter and optimizer memory falls with dp too (a (dp, cp) mesh would be HSDP: replicated over dp);
    gradients are summed over all of them, and the mesh shares the tp mesh's root."""
    if grid.layout.cp > 1:
        return grid.flat_mesh("dp", "cp", device_type=device_type)
    return grid.mesh("dp", device_type=device_type)

