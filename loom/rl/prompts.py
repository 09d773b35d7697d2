"""Where `loom rl`'s prompts come from, as `Prompt`s (tokens and media, the record the reward reads, a name):
- `TrainingPrompts`: the job's training samples (the built-in tasks, or data.sources' conversations), each cut
  where its last answer starts; that answer's text is the record's `answer`, which exact match compares;
- `JsonlPrompts` (`rl.prompts = FILE`): a user's lines of `messages` without the final assistant turn, rendered
  through the chat template up to its generation prompt; the line's other fields are the record (e.g. an
  "answer" for exact match). Every line is checked before any weight is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loom.data.chat import ChatTokenizer
from loom.data.conversation_format import MediaRules, media_items
from loom.data.conversations import BadSample, ConversationFile, json_record, parse_record
from loom.data.format import TokenCounter
from loom.data.sample import Sample, sequences_of
from loom.rl.rollouts import Prompt
from loom.train.evaluate import answer_span, prompt_of


class TrainingPrompts(Sequence):
    def __init__(self, samples: Sequence, tok) -> None:
        self.samples, self.tok = samples, tok

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Prompt:
        s = sequences_of(self.samples[i])[0]
        start, end = answer_span(s)
        record = {"task": s.task, "answer": self.tok.decode(s.tokens[start:end])}
        return Prompt(prompt_of(s), record, s.where or f"task {s.task!r}, sample {i}")


class JsonlPrompts(Sequence):
    def __init__(self, path: str | Path, chat: ChatTokenizer, media: MediaRules,
                 counters: dict[str, TokenCounter]) -> None:
        self.file, self.chat, self.media, self.counters = ConversationFile(path), chat, media, counters

    def __len__(self) -> int:
        return len(self.file)

    def __getitem__(self, i: int) -> Prompt:
        where = self.file.where(i)
        record = json_record(self.file.line(i), where)
        conv = parse_record(record, where, self.file.path.parent, prompt=True)
        images, clips, rows = media_items(conv, self.media, self.counters)
        tokens = self.chat.encode_prompt(conv, rows)
        sample = Sample(tokens, [False] * len(tokens), images, clips, conv.task or self.file.name, where)
        return Prompt(sample, {k: v for k, v in record.items() if k != "messages"}, where)

    def check_all(self) -> None:
        """Every line parsed, rendered and its media headers read now; one BadSample listing the first few."""
        problems = []
        for i in range(len(self)):
            try:
                self[i]
            except BadSample as e:
                problems.append(str(e))
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise BadSample(f"{len(problems)} bad prompts{more}:\n  " + "\n  ".join(problems[:5]))
