"""A user's own data: JSONL files of conversations in the chat format of Hugging Face multimodal processors.

One conversation per line:

    {"messages": [{"role": "user", "content": [{"type": "image", "path": "img/1.jpg"},
                                               {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}

`content` may also be a plain string (one text part); `{"type": "audio", "path": "a.wav"}` adds a clip; an
optional `"task": "name"` groups the line in held-out metrics (default: the file's stem). RL lines add GRPO's
`"advantage"` (and optional `"logprobs"`, `"ref_logprobs"`, one per completion token) for the last assistant
turn, or DPO's `"chosen"` and `"rejected"`: two answers (content lists or strings) to `messages` as a prompt.
Paths are relative to the JSONL file. A file is indexed once (the byte offset of every non-blank line) and
a line is parsed and checked only when read, so a large file costs no memory up front; every problem is a
`BadSample` naming file:line, the same on every rank (they all read the same bytes).

Several files mix by weight (`blend`): position j of the mixture takes the source furthest below its share
so far, so the mixture is a function of the weights alone — every layout and every resume sees the same one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROLES = ("system", "user", "assistant")
KINDS = ("text", "image", "audio")
MODULE_OF = {"image": "vision", "audio": "audio"}  # a media part's type → the encoder that reads it


class BadSample(ValueError):
    """A line that cannot be a training sample; the message starts with its file:line."""


@dataclass(frozen=True)
class Part:
    kind: str  # "text", "image" or "audio"
    text: str = ""  # a text part's text
    path: Path | None = None  # an image's or a clip's file, resolved against the JSONL's folder
    # media held in a table row instead of a file (data/table_media.py): a file's bytes, or a waveform and its rate
    data: bytes | None = field(default=None, compare=False, repr=False)
    wave: tuple | None = field(default=None, compare=False, repr=False)  # (samples: np.ndarray, sampling rate)
    name: str = ""  # how messages name embedded media (it has no path): "messages[1].content[0] (embedded)"

    @property
    def source(self) -> Path | bytes | tuple:
        """What the decoders read: the file, its bytes, or (waveform, rate)."""
        return self.path if self.path is not None else self.data if self.data is not None else self.wave


@dataclass(frozen=True)
class Turn:
    role: str
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]
    where: str  # "file:line", for every later message about this sample
    task: str | None = None  # the line's optional "task": its group in held-out metrics (else the file's stem)
    # RL's per-line values for the completion (the last assistant turn): "advantage" (a number), "logprobs" and
    # "ref_logprobs" (one per completion token)
    rl: dict[str, float | tuple[float, ...]] = field(default_factory=dict)
    # a DPO line's two answers to `turns` (the prompt): the "chosen" and the "rejected" assistant turn
    answers: tuple[Turn, Turn] | None = None

    def sides(self) -> tuple[Conversation, Conversation]:
        """A DPO line as two conversations, the prompt followed by the chosen, then by the rejected answer."""
        return tuple(Conversation(self.turns + (answer,), self.where, self.task) for answer in self.answers)

    def media(self, kind: str) -> list[Path]:
        """The files of one kind ("image" or "audio") in conversation order."""
        return [p.path for t in self.turns for p in t.parts if p.kind == kind]

    def items(self, kind: str) -> list[Part]:
        """The parts of one kind ("image" or "audio") in conversation order, files or embedded."""
        return [p for t in self.turns for p in t.parts if p.kind == kind]


# a table's hook for media parts without a "path" (data/table_media.py): (part, kind, where) → Part, or None
MediaHook = Callable[[dict, str, str], "Part | None"]


def parse_conversation(line: str, where: str, base: Path) -> Conversation:
    """One JSONL line → a checked Conversation; raises BadSample naming `where` and the problem."""
    return parse_record(json_record(line, where), where, base)


def json_record(line: str, where: str):
    """A JSONL line's object; a BadSample naming `where` when it is not JSON."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        # (some of json's messages end in "at" already: "Invalid control character at")
        raise BadSample(f"{where}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})") from None


def parse_record(record, where: str, base: Path, media: MediaHook | None = None, prompt: bool = False
                 ) -> Conversation:
    """One conversation as an object (a JSONL line's, or a table row's) → a checked Conversation; `media`
    resolves a media part that has no "path" (a table's embedded images and clips). `prompt`: an RL prompt,
    whose answer the sampler writes — its last turn must not be the assistant's."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise BadSample(f"{where}: a line must be an object with a non-empty \"messages\" list")
    turns = tuple(_turn(m, f"{where}: messages[{i}]", base, media) for i, m in enumerate(messages))
    answers = _answers(record, where, base, media)
    if prompt and turns[-1].role == "assistant":
        raise BadSample(f"{where}: a prompt ends with an assistant turn: leave the answer out, the sampler writes it "
                        f"(a reference answer for the reward goes in a field, e.g. \"answer\")")
    if not prompt and answers is None and not any(t.role == "assistant" and t.parts for t in turns):
        raise BadSample(f"{where}: no assistant turn: nothing to learn from this conversation")
    task = record.get("task")
    if task is not None and (not isinstance(task, str) or not task):
        raise BadSample(f"{where}: \"task\" must be a non-empty string (it names the sample's group in metrics)")
    rl = _rl_values(record, where)
    if answers is not None and rl:
        raise BadSample(f"{where}: a DPO pair (\"chosen\", \"rejected\") carries no {sorted(rl)}: those are GRPO's")
    return Conversation(turns, where, task, rl, answers)


def _answers(record: dict, where: str, base: Path, media: MediaHook | None) -> tuple[Turn, Turn] | None:
    """A DPO line's "chosen" and "rejected" answers (each a content list, or a string) as assistant turns; None
    on a line with neither."""
    given = [k for k in ("chosen", "rejected") if k in record]
    if not given:
        return None
    if len(given) == 1:
        missing = ({"chosen", "rejected"} - set(given)).pop()
        raise BadSample(f"{where}: has \"{given[0]}\" but no \"{missing}\": a DPO pair needs both answers")
    chosen, rejected = (_turn({"role": "assistant", "content": record[k]}, f"{where}: {k}", base, media)
                        for k in ("chosen", "rejected"))
    if chosen == rejected:
        raise BadSample(f"{where}: \"chosen\" and \"rejected\" are identical: the pair teaches nothing")
    if not chosen.parts or not rejected.parts:
        raise BadSample(f"{where}: an empty answer: \"chosen\" and \"rejected\" each need content")
    return chosen, rejected


RL_VALUES = ("advantage", "logprobs", "ref_logprobs")


def _rl_values(record: dict, where: str) -> dict[str, float | tuple[float, ...]]:
    """The line's RL values, checked: a finite advantage; logprobs lists of finite numbers ≤ 0."""
    out: dict[str, float | tuple[float, ...]] = {}
    if "advantage" in record:
        a = record["advantage"]
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
            raise BadSample(f"{where}: \"advantage\" must be a finite number, not {a!r}")
        out["advantage"] = float(a)
    for name in RL_VALUES[1:]:
        if name in record:
            values = record[name]
            if not isinstance(values, list) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v <= 0
                    for v in values):
                raise BadSample(f"{where}: \"{name}\" must be a list of finite log-probabilities (numbers ≤ 0), "
                                f"one per completion token")
            out[name] = tuple(float(v) for v in values)
    return out


def _turn(message, where: str, base: Path, media: MediaHook | None) -> Turn:
    if not isinstance(message, dict):
        raise BadSample(f"{where}: a message must be an object with \"role\" and \"content\"")
    role = message.get("role")
    if role not in ROLES:
        raise BadSample(f"{where}: unknown role {role!r}; roles are {list(ROLES)}")
    content = message.get("content")
    if isinstance(content, str):
        return Turn(role, (Part("text", text=content),))
    if not isinstance(content, list):
        raise BadSample(f"{where}: \"content\" must be a string or a list of parts")
    return Turn(role, tuple(_part(p, f"{where}.content[{j}]", base, media) for j, p in enumerate(content)))


def _part(part, where: str, base: Path, media: MediaHook | None) -> Part:
    kind = part.get("type") if isinstance(part, dict) else None
    # (a table row's parts carry every field of the column's struct, the unused ones None)
    if kind not in KINDS:
        raise BadSample(f"{where}: unknown part type {kind!r}; types are {list(KINDS)}")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise BadSample(f"{where}: a text part needs a \"text\" string")
        return Part("text", text=part["text"])
    if not isinstance(part.get("path"), str):
        embedded = media(part, kind, where) if media is not None else None
        if embedded is None:
            if media is None:
                raise BadSample(f"{where}: an {kind} part needs a \"path\" string (relative to the JSONL file)")
            raise BadSample(f"{where}: an {kind} part needs a \"path\" string (relative to the table's folder), an "
                            f"\"{kind}\" value, or an item of the row's {kind} column")
        return embedded
    return file_part(kind, part["path"], where, base)


def file_part(kind: str, path: str, where: str, base: Path) -> Part:
    """An image or clip in a file, `path` relative to `base`; a missing file is a BadSample naming `where`."""
    resolved = (base / path).resolve()
    if not resolved.is_file():
        raise BadSample(f"{where}: {kind} file {path!r} not found (looked at {resolved})")
    return Part(kind, path=resolved)


class Conversations:
    """A source's conversations by index: `len`, `[i]` (checked, raising BadSample), `where(i)`."""

    path: Path

    @property
    def name(self) -> str:
        """The source's name in metrics: its file's (or folder's) stem."""
        return self.path.stem

    def problems(self, check: Callable[[Conversation, str], object] | None = None, rank: int = 0, world: int = 1
                 ) -> dict[int, str]:
        """Every conversation that does not parse or check (a missing file included), or that `check(conversation,
        source name)` refuses: index → message; of every `world`-th from `rank` (a rank's share of the prescan). Run
        before training, so a bad line stops the run before any weight is read, not at the step that reads it."""
        out = {}
        for i in range(rank, len(self), world):
            try:
                conv = self[i]
                if check is not None:
                    check(conv, self.name)
            except BadSample as e:
                out[i] = str(e)
        return out


class ConversationFile(Conversations):
    """The conversations of one JSONL file, by index (blank lines are not conversations)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"data source {str(self.path)!r} does not exist")
        self._offsets: list[int] = []
        self._lines: list[int] = []  # 1-based line number of each conversation
        with open(self.path, "rb") as f:
            offset = 0
            for number, raw in enumerate(f, start=1):
                if raw.strip():
                    self._offsets.append(offset)
                    self._lines.append(number)
                offset += len(raw)

    def __len__(self) -> int:
        return len(self._offsets)

    def only(self, keep: list[int]) -> ConversationFile:
        """The same file with only the conversations `keep` (indices into this one), in that order."""
        out = object.__new__(ConversationFile)
        out.path, out._offsets, out._lines = self.path, [self._offsets[i] for i in keep], [self._lines[i] for i in keep]
        return out

    def where(self, i: int) -> str:
        return f"{self.path}:{self._lines[i]}"

    def line(self, i: int) -> str:
        """Conversation i's line as text (a BadSample when it is not UTF-8)."""
        with open(self.path, "rb") as f:
            f.seek(self._offsets[i])
            raw = f.readline()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadSample(f"{self.where(i)}: not UTF-8 ({e.reason} at byte {e.start})") from None

    def __getitem__(self, i: int) -> Conversation:
        return parse_conversation(self.line(i), self.where(i), self.path.parent)


def blend(sizes: list[int], weights: list[float], length: int) -> list[tuple[int, int]]:
    """`length` positions of a weighted mixture: (source, index within it). Position j goes to the source
    furthest below its share of the first j + 1 positions (the first such on a tie); each source is read in
    order and wraps around when used up."""
    if len(sizes) != len(weights) or not sizes:
        raise ValueError(f"{len(sizes)} sources but {len(weights)} weights")
    bad = [i for i, (n, w) in enumerate(zip(sizes, weights)) if n <= 0 or not w > 0]
    if bad:
        raise ValueError(f"sources {bad}: every source needs ≥ 1 conversation and a weight > 0")
    total = sum(weights)
    shares = [w / total for w in weights]
    taken = [0] * len(sizes)
    out = []
    for j in range(length):
        s = max(range(len(sizes)), key=lambda k: shares[k] * (j + 1) - taken[k])
        out.append((s, taken[s] % sizes[s]))
        taken[s] += 1
    return out
