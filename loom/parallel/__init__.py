"""Applies each module's layout to the model from outside, through one recipe per module kind, each in its own
order: `parallelize_language` (language.py: compile, activation checkpointing, PP split, TP/SP, FSDP2) and
`parallelize_encoder` (encoders.py: compile, activation checkpointing, TP/SP, FSDP2).

Every run goes through the recipes, one process too: without a process group a module has no grid, and its
recipe only compiles and checkpoints its blocks.
"""

from __future__ import annotations

from collections.abc import Callable

from loom.config import JobConfig
from loom.models.multimodal import MultimodalModel
from loom.parallel.compile import compile_blocks
from loom.parallel.encoders import parallelize_encoder
from loom.parallel.language import parallelize_language
from loom.topology import Topology

__all__ = ["parallelize", "parallelize_encoder", "parallelize_language"]

RECIPES: dict[str, Callable] = {"language": parallelize_language}  # any other module is an encoder


def parallelize(model: MultimodalModel, topo: Topology | None, cfg: JobConfig, device_type: str,
                compile_fn: Callable = compile_blocks) -> None:
    """Every module this rank hosts through its kind's recipe, on its own grid (`topo` None: every module, no
    layout); the recipe's result takes the module's place (the LLM under pp: this rank's `PipelinedLM`).
    `compile_fn` compiles a module's blocks (tests pass one with a cheaper backend)."""
    hosted = topo.role().modules if topo is not None else None
    for name in (*model.encoder_names, "language"):
        if hosted is not None and name not in hosted:
            continue
        recipe = RECIPES.get(name, parallelize_encoder)
        grid = topo.grids[name] if topo is not None else None
        setattr(model, name, recipe(name, model.get_submodule(name), grid, cfg, device_type, compile_fn))
