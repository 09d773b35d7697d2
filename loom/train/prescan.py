"""The prescan: every line of a user's data checked and measured before any weight is read, so a bad line stops
the run (or is skipped) before the first step, and every step is planned from the lines' shapes without rendering
them. In a world of several ranks each rank takes every world-th line of each source, and one all_gather_object
over a gloo group of the world combines what they found: every rank ends with every line's problems and shapes.
With data.prescan_cache a source's findings are kept beside it and read back by a later start (prescan_cache.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from loom.config import JobConfig
from loom.data.conversations import BadSample, Conversation, Conversations
from loom.data.format import TokenCounter
from loom.data.sample import sequences_of
from loom.data.shapes import SampleShape, shape_of
from loom.data.source import ChatRules, rules_sample
from loom.distributed import host_world_group
from loom.train.length_rules import fitting
from loom.train.prescan_cache import Findings, PrescanCache

Check = Callable[[Conversation, str], tuple[SampleShape, ...]]


def prescan(cfg: JobConfig, rules: ChatRules, counters: dict[str, TokenCounter], multiple: int | None,
            rollouts: bool = False) -> Check:
    """What the prescan asks of every line beyond its own format: everything the tokenizer and the model's config
    can judge — a media item for an encoder the model lacks, a media header that does not read, the chat template
    refusing it, a placeholder typed into the text, a clip longer than the audio encoder's positions, a sample
    over the token budget. Only pixels and samples are left to decode time. Returns the line's shapes (one per
    sequence), what planning a step needs of it."""
    most = cfg.model.audio.max_positions
    seen: dict[str, tuple[bool, str]] = {}  # an optional RL value → (given, where) on the first line checked

    def check(conv: Conversation, source: str) -> tuple[SampleShape, ...]:
        # `rollouts`: the steps train on `loom rl`'s own samples; the lines are prompts and held-out data
        if cfg.train.objective == "grpo" and not rollouts and "advantage" not in conv.rl:
            raise BadSample(f"{conv.where}: no \"advantage\": train.objective = 'grpo' needs one on every line")
        if (cfg.train.objective == "dpo") != (conv.answers is not None):
            raise BadSample(f"{conv.where}: no \"chosen\" and \"rejected\": train.objective = 'dpo' needs a pair on "
                            f"every line" if conv.answers is None else
                            f"{conv.where}: a DPO pair (\"chosen\", \"rejected\") but train.objective = "
                            f"{cfg.train.objective!r}: set train.objective = 'dpo'")
        for name in ("logprobs", "ref_logprobs"):  # a batch's samples carry the same fields
            given = name in conv.rl
            first_given, first = seen.setdefault(name, (given, conv.where))
            if given != first_given:
                raise BadSample(f"{conv.where}: {'has' if given else 'lacks'} \"{name}\" while {first} "
                                f"{'lacks' if given else 'has'} it: give it on every line or on none")
        sequences = sequences_of(rules_sample(conv, source, rules, counters))
        clips = [(k, clip) for s in sequences for k, clip in enumerate(s.audio)]
        for k, clip in clips:  # else the audio encoder's forward fails mid-run, on its ranks only
            if counters["audio"](clip) > most:
                raise BadSample(f"{conv.where}: clip {k + 1} gives {counters['audio'](clip)} frames after "
                                f"subsampling, more than model.audio.max_positions = {most}; shorten it, or raise "
                                f"max_positions")
        if multiple is not None:  # raises BadSample naming the line (unless too_long = "skip")
            fitting(sequences, [0] * len(sequences), cfg, multiple)
        return tuple(dataclasses.replace(shape_of(s, counters), where="") for s in sequences)  # the dataset has where

    return check


def scan(sources: list[Conversations], check: Check, cache: PrescanCache | None = None) -> list[Findings]:
    """Every line of `sources` through `check`: per source, its problems (index → message, in line order) and the
    shapes of the lines that passed. Shared over the ranks when there are several (a temporary gloo group of the
    world: the job's groups do not exist yet), so each rank parses and renders 1/world of the lines; a source
    whose findings `cache` holds on every rank is read from it, not scanned (rank 0 writes the ones scanned)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    with host_world_group() as group:
        known = [cache.load(f) if cache is not None else None for f in sources]
        if group is not None and cache is not None:  # a source is read from the cache on every rank, or scanned
            hits = torch.tensor([found is not None for found in known], dtype=torch.int64)
            dist.all_reduce(hits, op=dist.ReduceOp.MIN, group=group)
            known = [found if hit else None for found, hit in zip(known, hits.tolist())]
        todo = [k for k, found in enumerate(known) if found is None]
        if todo and (world > 1 or len(todo) < len(sources)):
            _prime(sources, check)
        measured: dict[str, tuple[SampleShape, ...]] = {}

        def measure(conv: Conversation, source: str) -> None:
            measured[conv.where] = check(conv, source)

        mine = {k: sources[k].problems(measure, rank, world) for k in todo}
        everyone = [(mine, measured)]
        if group is not None and todo:
            everyone = [None] * world
            dist.all_gather_object(everyone, (mine, measured), group=group)
        shapes = {w: s for _, theirs in everyone for w, s in theirs.items()}
        for k in todo:
            f = sources[k]
            problems = dict(sorted((i, m) for theirs, _ in everyone for i, m in theirs[k].items()))
            known[k] = problems, {i: shapes[f.where(i)] for i in range(len(f)) if i not in problems}
            if cache is not None and rank == 0:
                cache.save(f, known[k])
        return known


def _prime(sources: list[Conversations], check: Check) -> None:
    """`check` run on the lines in order until one passes: the state it keeps from the first line it meets (an RL
    value given on every line or on none) is then the same on every rank as on one process reading every line."""
    for f in sources:
        for i in range(len(f)):
            try:
                check(f[i], f.name)
                return
            except BadSample:
                continue
