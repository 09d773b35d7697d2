"""A rank's inputs for step s: the global batch drawn, this rank's microbatches planned and its media decoded
(train/inputs.py), every rank agreeing on samples found bad, and all of it prepared ahead by DataLoader workers.

Step s's samples are a function of (data.seed, s) alone (data/loader.py), so a worker can prepare step s + k
while step s trains: `StepPrefetcher` runs `plan_step` for the coming steps in `data.workers` processes, each
holding `data.prefetch_steps` steps ahead, pinned for asynchronous copies. Resuming at step s starts the
workers at s; the steps they return are the ones the main process would have planned, bit for bit.

Samples found bad (data.on_bad_sample): a line whose header or template fails is found by every rank alike
(each draws the whole global batch), a file that fails to decode only by the ranks whose encoder replicas
take it. `step_inputs` gathers both over the data group before the step, so every rank raises the same error,
or drops the same samples and plans the step again without them; the workers restart after a drop, so the
steps they prepare leave those samples out as well.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from loom.config import JobConfig
from loom.data.conversations import BadSample
from loom.data.format import TokenCounter
from loom.data.loader import GlobalBatches
from loom.data.sample import Sample, SamplePair, sequences_of
from loom.data.source import BadSamples
from loom.data.tokenizer import Vocabulary
from loom.train.build import RankPlan
from loom.train.inputs import StepInputs, fitting, plan_inputs


@dataclass
class Drawn:
    """Global batch s as every layout and the reference train on it."""

    samples: list[Sample]
    indices: list[int]  # their dataset indices
    too_long: int  # left out by data.too_long = "skip"
    bad: dict[int, str]  # dataset index → why: found bad when drawn (the same on every rank), left out


def draw(batches: GlobalBatches[Sample | SamplePair], step: int, cfg: JobConfig, multiple: int) -> Drawn:
    """The global batch's items as samples, a DPO pair as its two sequences side by side (both with its index)."""
    shard = batches.shard(step)
    bad = {i: str(s) for s, i in zip(shard, batches.indices(step)) if isinstance(s, BadSample)}
    good = [(s, i) for item, i in zip(shard, batches.indices(step)) if isinstance(item, (Sample, SamplePair))
            for s in sequences_of(item)]
    if not good:
        raise BadSample(f"step {step + 1}: every sample of the global batch is bad; nothing is left to train on")
    samples, indices, too_long = fitting([s for s, _ in good], [i for _, i in good], cfg, multiple)
    return Drawn(samples, indices, too_long, bad)


def global_batch(batches: GlobalBatches[Sample], step: int, cfg: JobConfig, multiple: int) -> list[Sample]:
    """The samples of global batch `step` (the reference's batch; bad ones left out)."""
    return draw(batches, step, cfg, multiple).samples


def plan_step(batches: GlobalBatches[Sample], step: int, cfg: JobConfig, tok: Vocabulary,
              counters: dict[str, TokenCounter], shares: dict[str, tuple[int, int]], multiple: int,
              device: torch.device = torch.device("cpu")) -> StepInputs:
    """This rank's microbatches of step `step`, on `device`; `failed`: every sample found bad here, drawn or
    decoded (no collective: a worker process runs it)."""
    drawn = draw(batches, step, cfg, multiple)
    inputs = plan_inputs(drawn.samples, drawn.indices, cfg, tok, counters, shares, multiple, device)
    inputs.failed.update(drawn.bad)
    if drawn.too_long:
        inputs.stats["skipped_too_long"] = float(drawn.too_long)
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
        where = getattr(batches.dataset, "where", lambda i: f"sample {i} of the dataset")
        for index, why in failed.items():
            batches.drop(index)
            bad.add(where(index), why)
        if not failed.keys() & set(inputs.indices):  # found when drawn: already left out of this plan
            inputs.failed = {}
            break
        inputs = planned()
    return inputs.to(device, non_blocking=True)


def agreed(failed: dict[int, str], group: dist.ProcessGroup | None) -> dict[int, str]:
    """The union of every rank's `failed` (one small gather over the data group, a gloo group of the world;
    none when the data has no files to decode)."""
    if group is None:
        return failed
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
