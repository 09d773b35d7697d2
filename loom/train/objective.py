"""The objective seam: what a step minimises (or, forward only, measures), given the LLM's logits and its batch.

An objective answers two questions, and the step program asks nothing else of it:
- `loss_sum(logits, batch)`: one microbatch's loss as a *sum* over its targets — on every layout the same
  function of the microbatch's rows (vocab-sharded logits under tensor parallel arrive as a DTensor, under
  `loss_parallel`);
- `normaliser(inputs)`: what the step divides every microbatch's sum by, from host data alone (every rank
  knows the whole global batch): the global supervised-token count for SFT, the sequences or pairs of the
  global batch for others. Dividing each microbatch by the *global* count is what makes every layout's
  gradient the reference's, for any dp, cp, pp, M or placement.
Per-token inputs beyond the labels (advantages, behaviour or reference logprobs) arrive in `batch.fields`,
packed, padded and CP-sharded like the labels.
"""

from __future__ import annotations

from typing import Protocol

import torch

from loom.data.batch import Batch
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
