"""The objective seam: what a step minimises (or, forward only, measures), given the LLM's logits and its batch.

An objective answers two questions, and the step program asks nothing else of it:
- `loss_sum(logits, batch)`: one microbatch's loss as a *sum* over its targets — on every layout the same
  function of the microbatch's rows (vocab-sharded logits under tensor parallel arrive as a DTensor, under
  `loss_parallel`);
- `normaliser(inputs)`: what the step divides every microbatch's sum by, from host data alone (every rank
  knows the whole global batch): the global supervised-token count for SFT, the sequences or pairs of the
  global batch for others. Dividing each microbatch by the *global* count is what makes every layout's
  gradient the reference's, for any dp, cp, pp, M or placement. It sees the whole microbatches before CP
  splits them, so an objective may derive per-token fields there (GRPO's sequence weights, DPO's sequences).
Per-token inputs beyond the labels (advantages, behaviour or reference logprobs) arrive in `batch.fields`,
packed, padded and CP-sharded like the labels. An objective may also keep metric sums on the side
(`metric_names`, `take_metrics()`: sums over its tokens or pairs, their count last; train/metric_sums.py): the
step adds them over the world and reports their means.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from loom.config import TrainConfig
from loom.data.batch import Batch
from loom.train.dpo import DPO
from loom.train.grpo import GRPO
from loom.train.inputs import StepInputs
from loom.train.loss import loss_function


class Objective(Protocol):
    def loss_sum(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor: ...

    def normaliser(self, inputs: StepInputs) -> int: ...


class SFT:
    """Next-token cross-entropy over the supervised tokens, divided by the step's global supervised-token count."""

    def __init__(self, compile_backend: str | None = None, vocab_sharded: bool = False) -> None:
        self.token_loss = loss_function(compile_backend, vocab_sharded)

    def loss_sum(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.token_loss(logits, batch.labels)

    def normaliser(self, inputs: StepInputs) -> int:
        return max(1, inputs.supervised)


def make_objective(train: TrainConfig, compile_backend: str | None, vocab_sharded: bool,
                   cp_group: dist.ProcessGroup | None) -> Objective:
    """The objective `train.objective` names, on logits compiled with `compile_backend` (None: eager),
    `vocab_sharded` or not; `cp_group`: the ranks sharing each sequence, for DPO's sums over whole sequences."""
    if train.objective == "grpo":
        return GRPO(train.grpo)
    if train.objective == "dpo":
        return DPO(train.dpo, cp_group)
    return SFT(compile_backend, vocab_sharded)


def metric_means(objective: Objective, reduce) -> dict[str, float]:
    """The objective's metrics over the step: its sums, added over the world by `reduce` (list → list), each
    divided by the token count that comes last; {} for an objective that keeps none."""
    names = getattr(objective, "metric_names", ())
    if not names:
        return {}
    sums = objective.take_metrics()  # None where no loss ran (a pipeline's earlier stage, an encoder rank) …
    *values, count = reduce([0.0] * (len(names) + 1) if sums is None else sums.tolist())  # … which reduces too
    return {name: v / max(count, 1.0) for name, v in zip(objective.metric_names, values)}
