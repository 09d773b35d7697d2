"""A sharded checkpoint's model weights read one tensor at a time, for export and `loom eval` on one
process: no rank needs the whole model in memory at once. For `loom eval` it is the job's weight source
(`build_job(weights=...)`), in place of the Hugging Face folders and seeded draws a training run starts from."""

from __future__ import annotations

from pathlib import Path

import torch

from loom.checkpoint.sharded import MODEL, CheckpointError, read_one, read_state, saved_metadata


class CheckpointWeights:
    """`names`: the model's weight names (as on one process); `get(name)`: one whole tensor; `state`: state.json."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.state = read_state(self.path)
        self._saved = saved_metadata(self.path)
        self.names = sorted(k[len(MODEL):] for k in self._saved if k.startswith(MODEL))
        self._saved_names = set(self.names)

    def get(self, name: str) -> torch.Tensor:
        return read_one(self.path, MODEL + name, self._saved[MODEL + name])

    def check_holds(self, names: set[str]) -> None:
        """Every weight in `names` is in the checkpoint: checked before any is read."""
        missing = sorted(names - set(self.names))
        if missing:
            raise CheckpointError(f"{self.path}: holds no {missing[:5]}{' …' if len(missing) > 5 else ''} "
                                  f"({len(missing)} of the {len(names)} tensors its config's model has)")

    def part(self, name: str, owner, attr: str, shape: torch.Size, box: tuple[slice, ...], device: torch.device,
             is_buffer: bool, into: torch.Tensor | None = None) -> torch.Tensor | None:
        """The part `box` of weight `name` (materialize's weight-source call); a buffer it lacks keeps its
        computed value. `into` goes unused: the part read is a tensor of its own, which materialize copies."""
        if name not in self._saved_names:
            if is_buffer:
                return None
            raise CheckpointError(f"{self.path}: holds no {name!r}")
        return self.get(name)[box].to(device)

    def close(self) -> None:
        pass  # every read opens and closes its own file
