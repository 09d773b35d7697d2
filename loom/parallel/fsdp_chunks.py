"""FSDP2 cuts each parameter into only the chunks a rank reads, not one per rank of its shard group.

Why. torch's `FSDPParam` (fsdp/_fully_shard/_fsdp_param.py) calls `_chunk_with_empty(param, shard_world_size,
dim)`: `torch.chunk` into up to dp views, then `new_empty(0)` until there are dp of them, for every parameter
on every rank — O(parameters × dp) at start-up (mm2b's 849 parameters at dp 8,192: ~29 of its 30 s; bench/
RESULTS.md, "A rank's start-up as the world grows"). It then reads two of them: `chunks[shard_rank]` (this rank's
shard) and `chunks[0]` (the padded shard size). `LazyChunks` is that list with each chunk made when indexed:
the same view `torch.chunk` returns (`narrow` at the same offset and length; the same `new_empty(0)` past the
last non-empty chunk), so the shards, their padding and their DTensor specs are bitwise those of torch's path
(tests/test_fsdp_chunks.py compares every chunk with torch's, and a fake dp-8,192 `fully_shard` with the
unpatched one). `chunk_lazily` puts it in place of the name `_fsdp_param` looks up; a torch without that
name, or with another signature, is left alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

try:
    from torch.distributed.fsdp._fully_shard import _fsdp_param
except ImportError:  # a torch without FSDP2's module: nothing to replace
    _fsdp_param = None


class LazyChunks(Sequence):
    """`_chunk_with_empty(tensor, num_chunks, dim)` as a sequence: chunk i is built when read, in O(1)."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        if tensor.dim() == 0 or num_chunks < 1:  # torch.chunk's own errors, raised now as torch would
            torch.chunk(tensor, num_chunks, dim=dim)
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim % tensor.dim()
        size = tensor.size(self.dim)
        # torch.chunk: views of ceil(size / n) along dim, the last shorter; n empty views of an empty dim
        self.chunk_size = -(-size // num_chunks)
        self.non_empty = num_chunks if size == 0 else -(-size // self.chunk_size)

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.num_chunks))]
        if index < 0:
            index += self.num_chunks
        if not 0 <= index < self.num_chunks:
            raise IndexError(f"chunk {index} of {self.num_chunks}")
        if index >= self.non_empty:  # _chunk_with_empty's padding: a 1-D empty tensor like the first chunk
            return self[0].new_empty(0)
        start = index * self.chunk_size
        return self.tensor.narrow(self.dim, start, min(self.chunk_size, self.tensor.size(self.dim) - start))


def lazy_chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int) -> LazyChunks:
    return LazyChunks(tensor, num_chunks, dim)


lazy_chunk_with_empty.loom_lazy_chunks = True


def chunk_lazily() -> bool:
    """Make FSDP2's parameter sharding build only the chunks it reads (idempotent); False where torch's code is
    not the one this was written against (then torch's own runs)."""
    if _fsdp_param is None:
        return False
    torch_chunks = getattr(_fsdp_param, "_chunk_with_empty", None)
    if torch_chunks is None:
        return False
    if getattr(torch_chunks, "loom_lazy_chunks", False):
        return True
    if list(inspect.signature(torch_chunks).parameters) != ["tensor", "num_chunks", "dim"]:
        return False
    _fsdp_param._chunk_with_empty = lazy_chunk_with_empty
    lazy_chunk_with_empty.torch_chunk_with_empty = torch_chunks  # for tests and benches: torch's own, to compare
    return True
