"""A checkpoint's model weights read one tensor at a time, from either form (sharded step-N or gathered
final/), for export and inspection on one process: no rank needs the whole model in memory at once."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from loom.checkpoint.sharded import MODEL, read_one, read_state, saved_metadata


class CheckpointWeights:
    """`names`: the model's weight names (as on one process); `get(name)`: one whole tensor; `state`: state.json."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.gathered = (self.path / "model.safetensors").is_file()
        self.state = read_state(self.path)
        if self.gathered:
            with safe_open(self.path / "model.safetensors", "pt") as f:
                self.names = list(f.keys())
        else:
            self._saved = saved_metadata(self.path)
            self.names = sorted(k[len(MODEL):] for k in self._saved if k.startswith(MODEL))

    def get(self, name: str) -> torch.Tensor:
        if self.gathered:
            with safe_open(self.path / "model.safetensors", "pt") as f:
                return f.get_tensor(name)
        return read_one(self.path, MODEL + name, self._saved[MODEL + name])
