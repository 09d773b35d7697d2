"""The prescan: every line of a user's data checked and measured before any weight is read, so a bad line stops
the run (or is skipped) before the first step, and every step is planned from the lines' shapes without rendering
them. In a world of several ranks each rank takes every world-th line of each source, and one all_gather_object
over a gloo group of the world combines what they found: every rank ends with every line's problems and shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.distributed as dist

from loom.config import JobConfig
from loom.data.conversations import BadSample, Conversation, Conversations
from loom.data.format import TokenCounter
from loom.data.sample import sequences_of
from loom.data.shapes import SampleShape, shape_of
from loom.data.source import ChatRules, rules_sample
from loom.train.inputs import fitting

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
        return tuple(dataclasses.replace(shape_of(s, counters), where="") for s in sequences)  # where: drawn

    return check


def scan(sources: list[Conversations], check: Check) -> tuple[list[dict[int, str]], dict[str, tuple[SampleShape, ...]]]:
    """Every line of `sources` through `check`: per source, its problems (index → message, in line order), and
    file:line → shapes for every line that passed. Shared over the ranks when there are several (a temporary gloo
    group of the world: the job's groups do not exist yet), so each rank parses and renders 1/world of the lines."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    measured: dict[str, tuple[SampleShape, ...]] = {}

    def measure(conv: Conversation, source: str) -> None:
        measured[conv.where] = check(conv, source)

    if world > 1:
        _prime(sources, check)
    found = [f.problems(measure, rank, world) for f in sources]
    if world == 1:
        return found, measured
    group = dist.new_group(backend="gloo")
    everyone: list[tuple[list[dict[int, str]], dict]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(everyone, (found, measured), group=group)
    dist.destroy_process_group(group)
    problems = [dict(sorted((i, m) for theirs, _ in everyone for i, m in theirs[k].items()))
                for k in range(len(sources))]
    return problems, {w: s for _, theirs in everyone for w, s in theirs.items()}


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
