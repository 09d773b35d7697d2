"""The LLM seam: how a step runs the LLM over its microbatches — one after another, or through the pipeline
schedule. Both take the same things (the microbatches, the step's row source, the objective and its
normaliser) and return this rank's part of the step's loss; training or forward only is one flag.

Each microbatch's LLM part is CP-sharded here, from host data on every rank (`context_share`), and the loss
runs under `loss_parallel` when the logits arrive vocab-sharded (LLM tp > 1), backward included.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from loom.data.batch import Batch
from loom.models.multimodal import MultimodalModel
from loom.parallel.context import shard_for_context
from loom.parallel.gradient_sync import set_gradient_sync
from loom.parallel.pipeline import MicrobatchData, Pipeline
from loom.train.inputs import StepBatch
from loom.train.objective import Objective
from loom.train.rows import RowSource


class LLMRunner(Protocol):
    def run(self, model: MultimodalModel, microbatches: list[StepBatch], rows: RowSource, objective: Objective,
            normaliser: int, how: RunContext, train: bool) -> float | torch.Tensor: ...


class RunContext:
    """What the LLM's microbatches run under on this rank: its cp group (None: no cp), vocab-sharded logits (loss
    parallel), the forward's autocast (bf16 on one process; under a layout FSDP's policy casts), and whether the
    head runs on the target rows alone (not under sequence parallel, whose final norm holds a sequence shard: the
    rows are picked from the whole sequence, which only the head's all-gather puts together)."""

    def __init__(self, cp_group: dist.ProcessGroup | None = None, vocab_sharded: bool = False,
                 autocast=contextlib.nullcontext, head_on_targets: bool = True) -> None:
        self.cp_group, self.vocab_sharded, self.autocast = cp_group, vocab_sharded, autocast
        self.head_on_targets = head_on_targets

    def context_share(self, model: MultimodalModel, llm: Batch) -> MicrobatchData:
        """This cp rank's part of a microbatch's LLM batch, with the selectors of its modality rows (or all); its
        target rows kept only where the head runs on them."""
        if not self.head_on_targets:
            llm = dataclasses.replace(llm, targets=None)
        if self.cp_group is None:
            return MicrobatchData(llm, None)
        return MicrobatchData(*shard_for_context(llm, self.cp_group, list(model.placeholder_ids.values())))

    def loss_context(self):
        return loss_parallel() if self.vocab_sharded else contextlib.nullcontext()


def whole_value(t: torch.Tensor) -> torch.Tensor:
    """The value of a loss that may be a replicated DTensor (loss parallel), as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class MicrobatchLoop:
    """The LLM not pipelined: microbatch after microbatch, gradients accumulated and reduced by FSDP once, after
    the last; each microbatch's loss sum divided by the normaliser before its backward."""

    def run(self, model: MultimodalModel, microbatches: list[StepBatch], rows: RowSource, objective: Objective,
            normaliser: int, how: RunContext, train: bool) -> float | torch.Tensor:
        total = 0.0  # a device tensor after the first microbatch: read once, at the end
        last = len(microbatches) - 1
        for i, mb in enumerate(microbatches):
            if train:
                set_gradient_sync(model, i == last)
            part = how.context_share(model, mb.llm)
            with how.loss_context():
                with how.autocast():
                    logits = model.language(part.batch.input_ids, part.batch.positions, part.batch.spans,
                                            rows.inserts(i, part.selectors), logits_at=part.batch.targets)
                loss_sum = objective.loss_sum(logits, part.batch.at_targets())
                if train:
                    (loss_sum / normaliser).backward()  # loss parallel needs its backward inside the context too
            if train:
                rows.backward_done(i)
            total = total + whole_value(loss_sum.detach())
        return total / normaliser  # a device tensor: the step reads it at its end


class ScheduleRunner:
    """The LLM pipelined: the schedule runs every microbatch (forward and backward, or forward only); stage 0
    asks the row source for each microbatch's rows as its forward runs, the last stage returns the objective's
    loss divided by the normaliser."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def run(self, model: MultimodalModel, microbatches: list[StepBatch], rows: RowSource, objective: Objective,
            normaliser: int, how: RunContext, train: bool) -> float:
        parts = [how.context_share(model, mb.llm) for mb in microbatches]
        with how.loss_context(), how.autocast():
            losses = self.pipeline.run(parts, rows, lambda logits, b: objective.loss_sum(logits, b) / normaliser, train)
        return float(losses)
