"""A job's samples by index, whichever their origin: the built-in tasks (byte tokenizer) or a user's JSONL
conversations (a Hugging Face tokenizer and its chat template). Data knows no model: how many rows an
encoder emits for an item comes in as `counters`.

Bad samples: a conversation found bad is either an error naming its file:line or, when skipped, recorded
in `BadSamples` — the same on every rank: the prescan checks every line (and measures its shape) before the
first step, and the few found bad only when a rank renders or decodes its share are agreed on before the step.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from loom.data.chat import ChatTokenizer
from loom.data.conversation_format import MediaRules, conversation_sample
from loom.data.conversations import BadSample, Conversation, ConversationFile, blend
from loom.data.tables import TableConversations, is_table
from loom.data.format import TokenCounter, to_sample
from loom.data.sample import Example, Sample, SamplePair, sequences_of
from loom.data.shape_table import ShapeTable
from loom.data.shapes import SampleShape, shape_of
from loom.data.task_outlines import example_outline
from loom.data.tasks import TaskDataset
from loom.data.tokenizer import ByteTokenizer


class TaskSamples:
    """The built-in tasks' examples as samples; with `pairs`, as DPO pairs: the answer chosen over the same
    answer reversed (a wrong answer in the answer's own characters; "?" appended where it reads the same)."""

    def __init__(self, tasks: TaskDataset, tok: ByteTokenizer, counters: dict[str, TokenCounter],
                 pairs: bool = False) -> None:
        self.tasks, self.tok, self.counters, self.pairs = tasks, tok, counters, pairs
        self.table: ShapeTable | None = None  # every item's shapes, measured once (train/job_data.py sets it)

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> Sample | SamplePair:
        return self._sample(self.tasks[i])

    def shape(self, i: int) -> tuple[SampleShape, ...]:
        """Item i's shapes, one per sequence, from its outline (data/task_outlines.py): no image or clip drawn."""
        outline = self._sample(self.tasks.example(i, example_outline))
        return tuple(shape_of(s, self.counters) for s in sequences_of(outline))

    def _sample(self, example: Example) -> Sample | SamplePair:
        chosen = to_sample(example, self.tok, self.counters)
        if not self.pairs:
            return chosen
        wrong = example.answer[::-1] if example.answer[::-1] != example.answer else example.answer + "?"
        return SamplePair(chosen, to_sample(dataclasses.replace(example, answer=wrong), self.tok, self.counters))


@dataclass(frozen=True)
class ChatRules:
    """How a conversation becomes a sample: the tokenizer, the media rules, which turns are targets."""

    chat: ChatTokenizer
    media: MediaRules
    train_on: str = "assistant"


def conversation_source(path: str | Path) -> ConversationFile | TableConversations:
    """A source's conversations: a JSONL file, or a table (a parquet file, a folder of parquet or arrow files)."""
    return TableConversations(path) if is_table(path) else ConversationFile(path)


class ConversationSamples:
    """Position j of a mixture of JSONL files → its conversation as a sample (`positions`: (file, index));
    `measured`: each file's conversations' shapes, by index (the prescan's), so a step is planned without
    rendering the lines it does not take."""

    def __init__(self, files: list[ConversationFile], positions: list[tuple[int, int]], rules: ChatRules,
                 counters: dict[str, TokenCounter], measured: list[list[tuple[SampleShape, ...]]] | None = None
                 ) -> None:
        self.files, self.positions, self.rules, self.counters = files, positions, rules, counters
        self.measured = measured
        self.table: ShapeTable | None = None  # every position's shapes, from `measured` (train/job_data.py sets it)

    @staticmethod
    def mixture(files: list[ConversationFile], weights: list[float], rules: ChatRules,
                counters: dict[str, TokenCounter], measured: dict[str, tuple[SampleShape, ...]] | None = None
                ) -> ConversationSamples:
        """One epoch of the weighted mixture: as many positions as the files hold conversations; `measured`:
        file:line → its shapes, for every conversation of the files (or None: measured when drawn)."""
        by_index = [[measured[f.where(k)] for k in range(len(f))] for f in files] if measured is not None else None
        return ConversationSamples(files, blend([len(f) for f in files], weights, sum(map(len, files))), rules,
                                   counters, by_index)

    def __len__(self) -> int:
        return len(self.positions)

    def where(self, i: int) -> str:
        f, k = self.positions[i]
        return self.files[f].where(k)

    def __getitem__(self, i: int) -> Sample | SamplePair:
        f, k = self.positions[i]
        return rules_sample(self.files[f][k], self.files[f].name, self.rules, self.counters)

    def shape(self, i: int) -> tuple[SampleShape, ...]:
        """Position i's shapes, one per sequence, as the prescan measured them (else measured now)."""
        if self.measured is None:
            return tuple(shape_of(s, self.counters) for s in sequences_of(self[i]))
        f, k = self.positions[i]
        return self.measured[f][k]


def rules_sample(conv: Conversation, source: str, rules: ChatRules, counters: dict[str, TokenCounter]
                 ) -> Sample | SamplePair:
    """One conversation of the source named `source` as a sample (media as headers only): what a step draws,
    and what the prescan builds for every line."""
    return conversation_sample(conv, rules.chat, rules.media, counters, source, rules.train_on)


def split_off(files: list[ConversationFile], weights: list[float], n: int
              ) -> tuple[list[ConversationFile], list[ConversationFile]]:
    """(train, held-out): each file's last conversations held out, ≈ n in all, in proportion to the weights
    (at least one from each file while n allows); each file keeps at least one to train on."""
    total = sum(weights)
    counts = [min(len(f) - 1, max(1 if n >= len(files) else 0, round(n * w / total))) for f, w in zip(files, weights)]
    train = [f.only(list(range(len(f) - c))) for f, c in zip(files, counts)]
    heldout = [f.only(list(range(len(f) - c, len(f)))) for f, c in zip(files, counts) if c]
    return train, heldout


@dataclass
class BadSamples:
    """Samples skipped under data.on_bad_sample = "skip": where (file:line) → why, in the order found."""

    found: dict[str, str] = field(default_factory=dict)

    def add(self, where: str, why: str) -> None:
        """`why` without a leading "where: " (a BadSample's message starts with it; `where` says it once)."""
        self.found.setdefault(where, why.removeprefix(f"{where}: "))

    def __len__(self) -> int:
        return len(self.found)

    def summary(self, limit: int = 3) -> str:
        first = "; ".join(f"{w}: {self.found[w]}" for w in list(self.found)[:limit])
        return f"{len(self)} bad samples skipped (data.on_bad_sample = \"skip\"), e.g. {first}"

    def write(self, path: Path) -> None:
        """One JSON line per skipped sample: {"where": file:line, "why": message}."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"where": w, "why": m}) + "\n" for w, m in self.found.items()))


def checked(files: list[ConversationFile], on_bad: str, bad: BadSamples, problems: list[dict[int, str]]
            ) -> list[ConversationFile]:
    """`files` after the prescan found `problems` in them (per file, index → message, in line order; every line
    parsed and checked before any weight is read): on error, one BadSample listing the first few problems and
    their count; on skip, the files without those lines (each recorded)."""
    problems = {f.path: p for f, p in zip(files, problems, strict=True)}
    messages = [m for p in problems.values() for m in p.values()]
    if messages and on_bad == "error":
        more = f" (and {len(messages) - 5} more)" if len(messages) > 5 else ""
        raise BadSample(f"{len(messages)} bad conversations{more}:\n  " + "\n  ".join(messages[:5]) +
                        "\n  fix them, or set data.on_bad_sample = \"skip\" to train without them")
    for f in files:
        for i, m in problems[f.path].items():
            bad.add(f.where(i), m)
    out = [f.only([i for i in range(len(f)) if i not in problems[f.path]]) for f in files]
    empty = [str(f.path) for f in out if not len(f)]
    if empty:
        raise BadSample(f"data source {empty[0]} has no usable conversation")
    return out
