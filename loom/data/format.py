"""Turns a task's Example into token ids: <bos>, modality placeholders, prompt, answer, <eos>."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loom.data.sample import Example, Sample
from loom.data.tokenizer import ByteTokenizer

# counts how many tokens an encoder emits for one input item (image or clip)
TokenCounter = Callable[[torch.Tensor], int]


@dataclass(frozen=True)
class RowCounter:
    """An encoder's two counts of an item: the LLM rows it becomes (its placeholders: calling it counts them) and
    the rows its tower runs, which the planner balances encoder replicas by. They differ beyond a constant factor
    only for LLaVA-OneVision's anyres images: every tile runs through the tower, the LLM reads a cut, pooled map."""

    llm: TokenCounter
    tower: TokenCounter

    def __call__(self, item) -> int:
        return self.llm(item)


def tower_rows(counter: TokenCounter, item) -> int:
    """The rows `counter`'s tower runs for `item` (a plain counter: the LLM rows it counts)."""
    return counter.tower(item) if isinstance(counter, RowCounter) else counter(item)


def prompt_tokens(example: Example, tok: ByteTokenizer, counters: dict[str, TokenCounter]) -> list[int]:
    """Everything the model is given before it must answer."""
    ids = [tok.bos_id]
    for modality, items in (("vision", example.images), ("audio", example.audio)):
        if items and modality not in counters:
            raise ValueError(
                f"task {example.task!r} has {modality} inputs but the model has no {modality} encoder; "
                f"add [model.{modality}] to the config or drop the task from data.tasks"
            )
        for item in items:
            ids += [tok.placeholder_ids[modality]] * counters[modality](item)
    return ids + tok.encode(example.prompt)


def to_sample(example: Example, tok: ByteTokenizer, counters: dict[str, TokenCounter]) -> Sample:
    prompt = prompt_tokens(example, tok, counters)
    answer = tok.encode(example.answer) + [tok.eos_id]
    return Sample(
        tokens=prompt + answer,
        supervised=[False] * len(prompt) + [True] * len(answer),
        images=list(example.images),
        audio=list(example.audio),
        task=example.task,
    )
