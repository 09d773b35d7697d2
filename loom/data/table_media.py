"""Images and clips held in a table row the way Hugging Face `datasets` stores them, as conversation parts.

A media value is one of:
- a `datasets` Image or Audio feature's storage: `{"bytes": the file's bytes, "path": its name}` — the bytes
  embedded (decoded by Pillow / soundfile), or, with no bytes, the path (relative to the table's folder);
- an audio array with its rate, `{"array": [...], "sampling_rate": n}` (a column of plain dicts; [channels,
  samples] arrays are averaged over channels when decoded);
- a string: a path.

It sits in the part itself (`{"type": "image", "image": ...}`, as HF processors' chat format puts it) or in a
column of the row, taken in order by the image / audio parts that have no source of their own: TRL's
`"images"` / `"audios"` lists, or one `"image"` / `"audio"` value (an ASR dataset's audio column); a row whose
column holds more items than its parts take is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loom.data.conversations import BadSample, Part, file_part

COLUMNS = {"image": ("images", "image"), "audio": ("audios", "audio")}  # a part kind → the row's columns for it


class RowMedia:
    """The media hook of one row (parse_record's `media`): each pathless part's value, from the part or the
    row's column, in order."""

    def __init__(self, record, base: Path) -> None:
        self.record = record if isinstance(record, dict) else {}
        self.base = base
        self.taken = dict.fromkeys(COLUMNS, 0)

    def __call__(self, part: dict, kind: str, where: str) -> Part | None:
        value = part.get(kind)
        if value is None:
            found = self._column(kind)
            if found is None:
                return None
            name, column = found
            j = self.taken[kind]
            if j >= len(column):
                raise BadSample(f"{where}: {kind} part {j + 1} of the row, but its {name!r} column holds "
                                f"{len(column)}")
            self.taken[kind] += 1
            value, where = column[j], f"{where} ({name}[{j}])"
        return media_part(value, kind, where, self.base)

    def _column(self, kind: str) -> tuple[str, list] | None:
        """The row's column of `kind` items as a list (one value: a list of one), and its name."""
        for name in COLUMNS[kind]:
            value = self.record.get(name)
            if value is not None and value != []:  # (a table column's rows without items hold [] or None)
                return name, value if isinstance(value, list) else [value]
        return None

    def check_all_taken(self, where: str) -> None:
        """Every item of the row's media columns was placed by a part (else the text does not say where)."""
        for kind in COLUMNS:
            found = self._column(kind)
            if found is not None and len(found[1]) > self.taken[kind]:
                raise BadSample(f"{where}: its {found[0]!r} column holds {len(found[1])} but its messages place "
                                f"{self.taken[kind]} (one {{\"type\": \"{kind}\"}} part per item)")


def media_part(value, kind: str, where: str, base: Path) -> Part:
    """One media value (a path, datasets' {bytes, path}, or {array, sampling_rate}) → a Part."""
    if isinstance(value, str):
        return file_part(kind, value, where, base)
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return Part(kind, data=bytes(value["bytes"]), name=_name(where))
        if kind == "audio" and value.get("array") is not None:
            return Part(kind, wave=_wave(value, where), name=_name(where))
        if isinstance(value.get("path"), str):
            return file_part(kind, value["path"], where, base)
    feature = "Image" if kind == "image" else "Audio"
    also = ", or {\"array\", \"sampling_rate\"}" if kind == "audio" else ""
    raise BadSample(f"{where}: an {kind} must be a path, or {{\"bytes\", \"path\"}} as datasets' {feature} feature "
                    f"stores it{also}; got {type(value).__name__}")


def _wave(value: dict, where: str) -> tuple[np.ndarray, int]:
    rate = value.get("sampling_rate")
    if not isinstance(rate, int) or rate <= 0:
        raise BadSample(f"{where}: an audio array needs a positive integer \"sampling_rate\", got {rate!r}")
    wave = np.asarray(value["array"], dtype=np.float32)
    if wave.ndim not in (1, 2) or wave.shape[-1] == 0:
        raise BadSample(f"{where}: an audio array must be [samples] or [channels, samples], got shape {wave.shape}")
    return wave, rate


def _name(where: str) -> str:
    """An embedded item's name in messages that already start with its row: the part within the row."""
    return where.rsplit(": ", 1)[-1] + " (embedded)"
