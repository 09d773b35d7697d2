"""This rank's part of a parameter, gradient or state tensor, whether sharded (a DTensor) or whole."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (this rank's shard, the same memory; no autograd through the DTensor), a plain
    tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t
