"""When a step's gradients are summed over each module's data-parallel replicas: after the backward whose sync is
on (the step's last microbatch's), FSDP2 reduce-scatters a sharded module's (parallel/fsdp.py), and a replicated
module's GradientSum all-reduces them (parallel/replicate.py); `finish_gradient_sync` waits for the latter."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from loom.parallel.replicate import gradient_sums


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduces gradients over the replicas. Off for all but a step's last microbatch:
    gradients accumulate unsharded on each rank and are reduced once per step (1/M of the traffic, for one
    unsharded gradient copy of memory). A model without a layout (one process) has nothing to switch."""
    for m in model.children():
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(enabled)
    for gradient_sum in gradient_sums(model):
        gradient_sum.set_sync(enabled)


def finish_gradient_sync(model: nn.Module) -> None:
    """After the step's last backward: the replicated modules' sums issued and waited for (FSDP2 waits for its
    reduce-scatters at the end of each backward itself)."""
    for gradient_sum in gradient_sums(model):
        gradient_sum.finish()
