"""Conversations in Hugging Face `datasets` folders and parquet files: the JSONL format's columns as a table.

A source path may be a parquet file, a folder of parquet files, or a folder `datasets.save_to_disk` wrote
(its `data-*.arrow` files); rows hold the JSONL lines' objects — a "messages" column (and optionally "task"),
media paths relative to the folder (to the file's folder for a parquet file). Read with pyarrow (arrow files
memory-mapped), so `datasets` itself is not needed; a row is turned into Python and checked only when read.
Rows are named `file:row N` (N from 1) in every message.
"""

from __future__ import annotations

from pathlib import Path

from loom.data.conversations import Conversation, Conversations, parse_record

SUFFIXES = (".parquet", ".arrow")


def is_table(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix in SUFFIXES or (path.is_dir() and any(p.suffix in SUFFIXES for p in path.iterdir()))


def _read(files: list[Path]):
    import pyarrow as pa  # optional: only a table source needs it (pip install 'loom[tables]')
    import pyarrow.parquet as pq

    tables = []
    for f in files:
        if f.suffix == ".parquet":
            tables.append(pq.read_table(f))
            continue
        source = pa.memory_map(str(f))
        try:  # datasets writes the streaming format
            tables.append(pa.ipc.open_stream(source).read_all())
        except pa.ArrowInvalid:
            tables.append(pa.ipc.open_file(source).read_all())
    return tables


class TableConversations(Conversations):
    """The conversations of one table source, by index; the same interface as ConversationFile."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"data source {str(self.path)!r} does not exist")
        files = sorted(p for p in self.path.iterdir() if p.suffix in SUFFIXES) if self.path.is_dir() else [self.path]
        if not files:
            raise FileNotFoundError(f"data source {str(self.path)!r}: no .parquet or .arrow files in it")
        self.base = self.path if self.path.is_dir() else self.path.parent
        self.tables = _read(files)
        # (table, row) of each conversation, and its name in messages
        self._rows = [(t, r) for t, table in enumerate(self.tables) for r in range(table.num_rows)]
        self._files = files

    def __len__(self) -> int:
        return len(self._rows)

    def only(self, keep: list[int]) -> TableConversations:
        out = object.__new__(TableConversations)
        out.__dict__.update(self.__dict__)
        out._rows = [self._rows[i] for i in keep]
        return out

    def where(self, i: int) -> str:
        t, r = self._rows[i]
        return f"{self._files[t]}:row {r + 1}"

    def __getitem__(self, i: int) -> Conversation:
        t, r = self._rows[i]
        record = self.tables[t].slice(r, 1).to_pylist()[0]
        return parse_record(record, self.where(i), self.base)
