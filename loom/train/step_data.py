"""A rank's inputs for step s: the global batch drawn, this rank's microbatches planned and its media decoded
(train/inputs.py), every rank agreeing on samples found bad, and all of it prepared ahead by DataLoader workers.

Step s's samples are a function of (data.seed, s) alone (data/loader.py), so a worker can prepare step s + k
while step s trains: `StepPrefetcher` runs `plan_step` for the coming steps in `data.workers` processes, each
holding `data.prefetch_steps` steps ahead, pinned for asynchronous copies. Resuming at step s starts the
workers at s; the steps they return are the ones the main process would have planned, bit for bit.

A rank plans its planning cells of the global batch (train/plan_cells.py) from their items' shapes (measured
once: data/shapes.py), adds up the whole batch's totals, and renders and decodes only the samples its LLM replica
and encoder replicas take, so its work per step is its share's, whatever the world. Samples found bad
(data.on_bad_sample): an item whose shape cannot be measured is found by every rank alike; a sample that fails to
render, or whose file fails to decode, only by the ranks that take it. `step_inputs` agrees on them over the data
group before the step — one all-reduce of a count, and a gather of the samples only in a step where some rank found
one — so every rank raises the same error, or drops the same samples and plans the step again without them; the
workers restart after a drop, so the steps they prepare leave those out as well.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from loom.config import JobConfig
from loom.data.conversations import BadSample
from loom.data.format import TokenCounter
from loom.data.loader import GlobalBatches
from loom.data.sample import Sample, SamplePair, sequences_of
from loom.data.shapes import shape_of
from loom.data.source import BadSamples
from loom.data.tokenizer import Vocabulary
from loom.train.build import RankPlan
from loom.train.inputs import StepInputs, plan_cells
from loom.train.step_draw import Drawn, draw, named


def rendered(batches: GlobalBatches[Sample | SamplePair], step: int, drawn: Drawn, counters: dict[str, TokenCounter]
             ) -> Callable[[int], Sample]:
    """Position p of the drawn batch rendered (the chat template, the tokenizer, the media headers), checked to
    have the shape it was planned with; a BadSample names its line when it is not (its file changed since the
    prescan) or no longer renders."""
    def render(p: int) -> Sample:
        index = int(drawn.indices[p])
        item = batches.item(step, index)
        if isinstance(item, BadSample):
            raise item
        sample = sequences_of(item)[drawn.sequence(p)]
        planned, shape = drawn.shapes.shape(p), shape_of(sample, counters)
        if not shape.same_as(planned):
            where = planned.where or named(batches)(index)
            raise BadSample(f"{where}: renders to {shape.tokens} tokens and rows {shape.rows}, but measured "
                            f"{planned.tokens} and {planned.rows} at start-up: did its file change since?")
        return sample
    return render


def global_batch(batches: GlobalBatches[Sample], step: int, cfg: JobConfig, counters: dict[str, TokenCounter],
                 multiple: int) -> list[Sample]:
    """The samples of global batch `step`, every one rendered (the reference's batch; bad ones left out)."""
    drawn = draw(batches, step, cfg, counters, multiple)
    return list(map(rendered(batches, step, drawn, counters), range(len(drawn.shapes))))


def plan_step(batches: GlobalBatches[Sample], step: int, cfg: JobConfig, tok: Vocabulary,
              counters: dict[str, TokenCounter], shares: dict[str, tuple[int, int]], multiple: int,
              device: torch.device = torch.device("cpu")) -> StepInputs:
    """This rank's microbatches of step `step`, on `device`, planned from the shapes of its planning cells'
    samples (train/step_draw.py) with only this rank's share rendered and decoded; `failed`: every sample found
    bad here, measured, rendered or decoded (no collective: a worker process runs it)."""
    drawn = draw(batches, step, cfg, counters, multiple, shares)
    inputs = plan_cells(drawn.batch, rendered(batches, step, drawn, counters), cfg, tok, counters, shares, multiple,
                        device)
    inputs.failed.update(drawn.bad)
    inputs.left_out = frozenset(drawn.bad)
    if drawn.batch.totals.skipped:
        inputs.stats["skipped_too_long"] = float(drawn.batch.totals.skipped)
    return inputs


def step_inputs(batches: GlobalBatches[Sample], step: int, plan: RankPlan, cfg: JobConfig, tok: Vocabulary,
                counters: dict[str, TokenCounter], device: torch.device, bad: BadSamples | None = None,
                prepared: StepInputs | None = None) -> StepInputs:
    """This rank's inputs of step `step` on `device` (`prepared`: planned ahead on the host by a worker), once
    every rank agrees on the samples found bad: all raise the first (data.on_bad_sample = "error"), or all
    drop them, record them in `bad` and plan the step again if they were in it."""
    def planned() -> StepInputs:
        return plan_step(batches, step, cfg, tok, counters, plan.shares, plan.sample_multiple)

    inputs = prepared if prepared is not None else planned()
    while failed := agreed(inputs.failed, plan.data_group):
        if cfg.data.on_bad_sample == "error" or bad is None:
            raise BadSample(failed[min(failed)])
        where = named(batches)
        for index, why in failed.items():
            batches.drop(index)
            bad.add(where(index), why)
        if failed.keys() <= inputs.left_out:  # all found when drawn: already left out of every rank's plan
            inputs.failed = {}
            break
        inputs = planned()
    return inputs.to(device, non_blocking=True)


def agreed(failed: dict[int, str], group: dist.ProcessGroup | None) -> dict[int, str]:
    """The union of every rank's `failed` over the data group, a gloo group of the world (none when the data has
    no files to decode): one all-reduce of a count, and a gather of the samples only when some rank found one."""
    if group is None:
        return failed
    found = torch.tensor([len(failed)])
    dist.all_reduce(found, group=group)
    if not found.item():
        return {}
    everyone: list[dict[int, str]] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(everyone, failed, group=group)
    return {i: why for found in everyone for i, why in found.items()}


class _Steps(Dataset):
    """Steps first … last - 1 as a map-style dataset: item k is step first + k planned (a BadSample that
    stops the run is returned, not raised, so the main process raises it with its own message)."""

    def __init__(self, plan: Callable[[int], StepInputs], first: int, last: int) -> None:
        self.plan, self.first, self.last = plan, first, last

    def __len__(self) -> int:
        return self.last - self.first

    def __getitem__(self, k: int) -> StepInputs | BadSample:
        try:
            return self.plan(self.first + k)
        except BadSample as e:
            return e


class StepPrefetcher:
    """`get(s)`: step s planned by a worker (None with no workers: the caller plans it). Workers are forked
    with the drops known then; a step out of order, or a drop since, restarts them at the asked step."""

    def __init__(self, batches: GlobalBatches[Sample], plan: Callable[[int], StepInputs], last: int, workers: int,
                 prefetch_steps: int, pin: bool) -> None:
        self.batches, self.plan, self.last = batches, plan, last
        self.workers, self.prefetch_steps, self.pin = workers, prefetch_steps, pin
        self._it, self._next, self._dropped = None, -1, 0

    def get(self, step: int) -> StepInputs | None:
        if not self.workers:
            return None
        if self._it is None or step != self._next or len(self.batches.dropped) != self._dropped:
            self._start(step)
        item = next(self._it)
        self._next += 1
        if isinstance(item, BadSample):
            raise item
        return item

    def _start(self, step: int) -> None:
        self.close()
        # a tokenizer used before the fork would warn, and turn its own threads off, in every worker
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        loader = DataLoader(_Steps(self.plan, step, self.last), batch_size=None, num_workers=self.workers,
                            prefetch_factor=self.prefetch_steps, pin_memory=self.pin,
                            # fork: the workers inherit the dataset and tokenizer as they are, nothing pickled
                            multiprocessing_context="fork")
        self._it, self._next, self._dropped = iter(loader), step, len(self.batches.dropped)

    def close(self) -> None:
        self._it = None  # the last reference: the iterator shuts its workers down
