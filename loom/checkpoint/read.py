"""A sharded checkpoint's model weights read one tensor at a time, for export and `loom eval` on one
process: no rank needs the whole model in memory at once."""

from __future__ import annotations

from pathlib import Path

import torch

from loom.checkpoint.sharded import MODEL, read_one, read_state, saved_metadata


class CheckpointWeights:
    """`names`: the model's weight names (as on one process); `get(name)`: one whole tensor; `state`: state.json."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.state = read_state(self.path)
        self._saved = saved_metadata(self.path)
        self.names = sorted(k[len(MODEL):] for k in self._saved if k.startswith(MODEL))

    def get(self, name: str) -> torch.Tensor:
        return read_one(self.path, MODEL + name, self._saved[MODEL + name])
