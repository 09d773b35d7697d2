"""What every bridge shares: each replica's row count on both sides (from host data), and the CP sum of the
rows' gradient. Every bridge — colocated (bridge/colocated.py), into a pipelined LLM's first stage
(bridge/first_stage.py), point to point (bridge/p2p.py) — moves one encoder's rows `[rows, hidden]` from its
replicas to the LLM ranks that insert them, and brings their gradient back; under LLM cp that gradient is first
summed over the cp group (`sum_over_context`), because each cp rank inserted only the rows of its own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ReplicaRows:
    """One microbatch's modality rows of one encoder, per replica on each side of its bridge: a list of every
    replica's, or, where the step was planned in cells, a `KnownRows` of the replicas of this rank's blocks."""

    encoder: Sequence[int]  # rows held by each encoder replica (dp index order)
    llm: Sequence[int]  # rows needed by each LLM replica (dp index order)


def sum_over_context(grad: torch.Tensor, cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Under LLM cp each rank inserted only the rows of its own tokens, so its gradient is zero elsewhere
    (the adjoint of selecting rows is a zero-padded scatter): the full gradient is the sum over cp."""
    if cp_group is None:
        return grad
    grad = grad.contiguous().clone()
    dist.all_reduce(grad, group=cp_group)
    return grad
