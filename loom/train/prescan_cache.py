"""The prescan's findings kept beside each source (data.prescan_cache = true), so a start on the same files under
the same config reads every line's problems and shapes back instead of parsing and rendering every line again.

A source's file is `<source>.prescan-<key>.json`, the key a hash of everything the findings depend on: the
source's path, size and modification time (each file's, for a folder of tables); the config's data and model
sections, the objective, the layout's sample multiple; the size and time of each file in any folder the model
config names (the tokenizer and its chat template, preprocessor configs); and loom's data code. Another config
or an edited source writes another file. A media file edited in place is not in the key: a sample that no longer
renders to its cached shape is a BadSample naming its line at the step that draws it (train/step_data.py).
A data folder that is not writable keeps no cache; a cache file that does not read is scanned again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from loom.config import JobConfig
from loom.data.conversations import Conversations
from loom.data.shapes import SampleShape

# a source's problems (index → message) and the shapes of its lines that passed (index → one per sequence)
Findings = tuple[dict[int, str], dict[int, tuple[SampleShape, ...]]]
# data keys the prescan does not read: a change in them keeps the cache
NOT_READ = ("tasks", "train_size", "heldout_size", "sources", "heldout", "seed", "workers", "prefetch_steps",
            "prescan_cache", "encoder_rows_per_microbatch")
DATA_CODE = Path(__file__).resolve().parent.parent / "data"  # what turns a line into its sample


class PrescanCache:
    def __init__(self, config_key: str) -> None:
        self.config_key = config_key

    @staticmethod
    def of(cfg: JobConfig, multiple: int | None, rollouts: bool) -> PrescanCache:
        data = {k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in NOT_READ}
        model = dataclasses.asdict(cfg.model)
        folders = sorted({v for v in _strings(model) if v and os.path.isdir(v)})
        code = [Path(__file__).with_name("prescan.py"), *sorted(DATA_CODE.glob("*.py"))]
        parts = {"data": data, "model": model, "objective": cfg.train.objective, "multiple": multiple,
                 "rollouts": rollouts, "folders": [_stats(Path(f)) for f in folders],
                 "code": hashlib.sha256(b"".join(p.read_bytes() for p in code)).hexdigest()}
        return PrescanCache(_digest(parts))

    def path(self, source: Conversations) -> Path:
        p = source.path.resolve()
        key = _digest({"config": self.config_key, "source": str(p), "stats": _stats(p)})[:16]
        return p.with_name(f"{p.name}.prescan-{key}.json")

    def load(self, source: Conversations) -> Findings | None:
        """The source's findings as a start under this key wrote them; None when there are none that read."""
        try:
            saved = json.loads(self.path(source).read_text())
            problems = {int(i): m for i, m in saved["problems"].items()}
            shapes = {i: tuple(SampleShape(t, n, _tuples(rows), frozenset(fields), tower=_tuples(tower))
                               for t, n, rows, fields, tower in seqs) for i, seqs in enumerate(saved["shapes"]) if seqs}
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if len(problems) + len(shapes) != len(source):  # not this source's lines
            return None
        return problems, shapes

    def save(self, source: Conversations, found: Findings) -> None:
        """Written whole or not at all (another start may read it while this one writes)."""
        problems, shapes = found
        seqs = [[[s.tokens, s.targets, s.rows, sorted(s.fields), s.tower] for s in shapes[i]] if i in shapes
                else None for i in range(len(source))]
        path = self.path(source)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"problems": problems, "shapes": seqs}))
            os.replace(tmp, path)
        except OSError:  # a read-only data folder: the next start scans again
            tmp.unlink(missing_ok=True)


def _tuples(rows: dict[str, list[int]]) -> dict[str, tuple[int, ...]]:
    return {e: tuple(r) for e, r in rows.items()}


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def _stats(path: Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of a file, or of each file in a folder."""
    # (a cache file of a source in the same folder is not what the findings depend on)
    files = sorted(p for p in path.iterdir() if p.is_file() and ".prescan-" not in p.name) if path.is_dir() else [path]
    return [(p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files]


def _digest(parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
