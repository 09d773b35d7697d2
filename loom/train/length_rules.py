"""The length rules of a step's samples, on the host: what bounds one sample (T packed, S padded), the padded
length S when left to the data, which samples fit (data.too_long), and the check of a source's longest sample
before training. Apart from train/inputs.py so the array planner (train/step_parts.py) reads them without a cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from loom.config import ConfigError, JobConfig
from loom.data.batch import round_up
from loom.data.conversations import BadSample
from loom.data.sample import Sample
from loom.data.shapes import SampleShape


def limit(cfg: JobConfig) -> tuple[str, int]:
    """The key and value that bound one sample's padded length: T packed, S padded (0: no bound)."""
    if cfg.data.format == "thd":
        return "data.tokens_per_microbatch", cfg.data.tokens_per_microbatch
    return "data.padded_length", cfg.data.padded_length


def with_padded_length(cfg: JobConfig, longest: dict[str, int], multiple: int) -> JobConfig:
    """Padded (bshd) batches: `cfg` with data.padded_length = S checked against the sample multiple, or,
    when 0, set to the data's longest sample rounded up to it (`longest`: source → its longest sample)."""
    if cfg.data.format != "bshd":
        return cfg
    s = cfg.data.padded_length
    if s % multiple:
        raise ConfigError(
            f"data.padded_length = {s} is not a multiple of {multiple}, the sample multiple of this layout (2·cp, "
            f"·tp under sequence parallel, and data.pad_to_multiple); use {s // multiple * multiple or multiple} or "
            f"{(s // multiple + 1) * multiple}, or 0 for the longest sample")
    s = s or round_up(max(longest.values()), multiple)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, padded_length=s))


def fitting(samples: list[Sample] | list[SampleShape], indices: list[int], cfg: JobConfig, multiple: int,
            named: Callable[[int], str] | None = None) -> tuple[list, list[int], int]:
    """With data.too_long = "skip": the samples (or their shapes) whose padded length fits a microbatch (T packed,
    S padded) — a DPO pair's two together, as they share one — their dataset indices, and how many were dropped
    (the reference drops the same ones). Otherwise all, or a BadSample naming the first that does not fit
    (`named`: dataset index → its file:line, for samples that do not say)."""
    key, budget = limit(cfg)
    if not budget:
        return samples, indices, 0
    together = cfg.data.format == "thd"  # packed: a pair's two sequences share T; padded: each its own row

    def need(group: list[int]) -> int:
        padded = [round_up(len(samples[p]), multiple) for p in group]
        return sum(padded) if together else max(padded)

    groups = item_groups(indices)
    if cfg.data.too_long != "skip":  # the built-in tasks' longest was checked up front; a user's shows here
        for group in groups:
            if need(group) > budget:
                s, index = samples[group[0]], indices[group[0]]
                where = s.where or (named(index) if named else f"sample {index} of the dataset")
                if len(group) == 1 or not together:
                    long = max(group, key=lambda p: len(samples[p]))
                    raise BadSample(f"{where}: {len(samples[long])} tokens (padded to a multiple of {multiple}: "
                                    f"{round_up(len(samples[long]), multiple)}) exceed {key} = {budget}; raise it, or "
                                    f"set data.too_long = \"skip\" to drop such samples")
                sizes = " + ".join(str(round_up(len(samples[p]), multiple)) for p in group)
                raise BadSample(f"{where}: the DPO pair's answers need {sizes} = {need(group)} tokens together "
                                f"(each padded to a multiple of {multiple}; a pair shares a microbatch), more than "
                                f"{key} = {budget}; raise it, or set data.too_long = \"skip\" to drop such pairs")
        return samples, indices, 0
    keep = [p for group in groups if need(group) <= budget for p in group]
    return [samples[p] for p in keep], [indices[p] for p in keep], len(samples) - len(keep)


def item_groups(indices: list[int]) -> list[list[int]]:
    """Positions of a global batch grouped by the dataset item they came from: a DPO pair's two sequences carry
    their item's index side by side (train/step_data.py `draw`); every other sample is a group of its own."""
    groups: list[list[int]] = []
    for p, index in enumerate(indices):
        if groups and indices[groups[-1][0]] == index:
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def check_longest(cfg: JobConfig, longest: dict[str, int], multiple: int) -> None:
    """Before training: a data source whose longest sample (padded) exceeds the limit (T packed, S padded) is
    an error now, unless data.too_long = "skip" — not at the step that draws it. `longest`: source → its
    longest sample."""
    key, budget = limit(cfg)
    if not budget or cfg.data.too_long == "skip":
        return
    for source, n in longest.items():
        if round_up(n, multiple) > budget:
            raise ConfigError(
                f"{key} = {budget}, but {source} samples reach {n} tokens (padded to a multiple of {multiple}: "
                f"{round_up(n, multiple)}); raise {key} to at least {round_up(n, multiple)}, or set "
                f"data.too_long = \"skip\" to drop such samples")
