"""Conversations in Hugging Face `datasets` folders and parquet files: the JSONL format's columns as a table.

A source path may be a parquet file, a folder of parquet files, or a folder `datasets.save_to_disk` wrote
(its `data-*.arrow` files); rows hold the JSONL lines' objects — a "messages" column (and optionally "task"),
media paths relative to the folder (to the file's folder for a parquet file), or media embedded as `datasets`
stores them (data/table_media.py: Image / Audio features' bytes, audio arrays with their rate, TRL's "images"
column). Read with pyarrow, so `datasets` itself is not needed: arrow files memory-mapped, parquet files one
row group at a time (the group of the row asked for, the last one kept), never a whole file in memory; a row is
turned into Python and checked only when read. Rows are named `file:row N` (N from 1) in every message.
"""

from __future__ import annotations

import bisect
import itertools
from pathlib import Path

from loom.data.conversations import Conversation, Conversations, parse_record
from loom.data.table_media import RowMedia

SUFFIXES = (".parquet", ".arrow")


def is_table(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix in SUFFIXES or (path.is_dir() and any(p.suffix in SUFFIXES for p in path.iterdir()))


class _ParquetRows:
    """A parquet file's rows by index, read a row group at a time (the last group read is kept)."""

    def __init__(self, path: Path) -> None:
        import pyarrow.parquet as pq  # optional: only a table source needs it (pip install 'loom[tables]')

        self.path = path
        meta = pq.ParquetFile(path).metadata
        self.starts = [0, *itertools.accumulate(meta.row_group(g).num_rows for g in range(meta.num_row_groups))]
        self.num_rows = self.starts[-1]
        self._group: tuple[int, object] | None = None  # (index, its table)

    def row(self, r: int) -> dict:
        import pyarrow.parquet as pq

        g = bisect.bisect_right(self.starts, r) - 1
        if self._group is None or self._group[0] != g:  # opened per group read: nothing shared across forks
            self._group = (g, pq.ParquetFile(self.path).read_row_group(g))
        return self._group[1].slice(r - self.starts[g], 1).to_pylist()[0]


class _ArrowRows:
    """An arrow file's rows by index, memory-mapped (the file's pages are read as rows are)."""

    def __init__(self, path: Path) -> None:
        import pyarrow as pa

        source = pa.memory_map(str(path))
        try:  # datasets writes the streaming format
            self.table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            self.table = pa.ipc.open_file(source).read_all()
        self.num_rows = self.table.num_rows

    def row(self, r: int) -> dict:
        return self.table.slice(r, 1).to_pylist()[0]


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
        self.tables = [_ParquetRows(f) if f.suffix == ".parquet" else _ArrowRows(f) for f in files]
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
        record, where = self.tables[t].row(r), self.where(i)
        media = RowMedia(record, self.base)
        conversation = parse_record(record, where, self.base, media)
        media.check_all_taken(where)
        return conversation
