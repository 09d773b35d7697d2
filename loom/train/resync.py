"""Before each compared step of `loom verify`: the layout restarts from the reference's state.

Two runs that start bitwise equal drift apart after one step: the order of reductions differs by rounding,
and AdamW's g / (√v + eps) amplifies that rounding for gradient elements near eps. Left alone, step k would
compare k − 1 steps of amplified drift rather than the layout. So before every step after the first, each
rank writes the reference's weights and AdamW state (exp_avg, exp_avg_sq, step) into the parts of them it
holds: its shards of the DTensors of FSDP2/TP, of its pipeline stages only, of its hosted modules only. The
only difference left inside a step is then the layout's own arithmetic.

Every rank holds the whole reference, so each copies its own box of each tensor: no collective.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from loom.parallel.materialize import local_part
from loom.parallel.tied import tied_copy_names
from loom.train.optim import ModuleOptimizers


def resync_from_reference(model: nn.Module, optimizer: ModuleOptimizers, reference: nn.Module,
                          ref_optimizer: ModuleOptimizers) -> None:
    """Sets this rank's parts of `model`'s parameters and of their optimizer state to the reference's values.
    A copy of a tied weight (a pipelined LLM's head copy of the embedding) gets the tied weight's values.
    A parameter with optimizer state on one side only keeps its own: its gradient was present on one side
    only, which verify has already reported as a failure."""
    twins = tied_copy_names(model)
    ref_params = dict(reference.named_parameters())
    state, ref_state = optimizer.state, ref_optimizer.state
    with torch.no_grad():
        for name, p in model.named_parameters():
            ref = ref_params[twins.get(name, name)]
            _copy_into_part(p, ref)
            if p in state and ref in ref_state:
                for field, value in state[p].items():
                    _copy_into_part(value, ref_state[ref][field])


def _copy_into_part(t: torch.Tensor, whole: torch.Tensor) -> None:
    """Writes `whole`'s values into `t`, or into the part of it this rank holds when `t` is a DTensor."""
    local, box = local_part(t)
    if local.numel() == 0:  # an uneven split left this rank nothing of it
        return
    local.copy_(whole[box])
