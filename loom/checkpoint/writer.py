"""A checkpoint writer that streams each rank's shards to disk, several files at once, in the same format.

torch's HuggingFaceStorageWriter hands a file's tensors to `safetensors.torch.save`, which builds the whole file
as one bytes object (a second host copy of the rank's shard) before one `write`, and it puts a rank's shards in
one file, so its `thread_count` has nothing to share out. This writer keeps its format — safetensors files
with DCP's sharding metadata (`DCP_SHARDING_INFO`: each tensor's offsets in the global tensor), which
HuggingFaceStorageReader reads under any layout — and changes only how the bytes get there:
  - a rank's write items are split by size over `threads` files, one thread writing each;
  - each file's header is built from the plan (names, dtypes, shapes), then every tensor's bytes are written
    straight from its memory (a CPU tensor's buffer), never gathered into one object;
  - a GPU tensor goes through two page-locked buffers of CHUNK bytes per thread, the copy of the next chunk
    overlapping the write of this one.
"""

from __future__ import annotations

import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

CHUNK = 32 << 20  # bytes per staging buffer: 2 per thread, page-locked, for GPU tensors only
# the safetensors header fields torch's writer puts in each file, and its reader reads (DCP_SHARDING_INFO)
SHARDING_KEY, VERSION_KEY, OFFSETS_KEY = "DCP_SHARDING_INFO", "DCP_VERSION", "saved_offsets"
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
# a test may send CPU tensors through the staging path too: it is the GPU path's logic without a GPU
STAGE_CPU_TENSORS = False


@dataclass
class StoredItem:
    """Where a write item's bytes went (torch's writer keeps the same three fields; its `finish` reads them)."""

    relative_path: str
    offset: int
    length: int


def file_name(index: int, count: int, shard: int | None) -> str:
    """torch's names for the HF writer's files: `shard-R-model-I-of-N` when each rank writes its own (R from 1)."""
    name = f"model-{index:05d}-of-{count:05d}.safetensors"
    return name if shard is None else f"shard-{shard:05d}-{name}"


def split_by_size(items: list[WriteItem], files: int) -> list[list[WriteItem]]:
    """The items in `files` groups of about equal bytes (largest first, each to the lightest group); no group
    is empty, so a rank with fewer items than files writes fewer files."""
    groups: list[list[WriteItem]] = [[] for _ in range(max(1, min(files, len(items))))]
    sizes = [0] * len(groups)
    for item in sorted(items, key=_nbytes, reverse=True):
        k = sizes.index(min(sizes))
        groups[k].append(item)
        sizes[k] += _nbytes(item)
    return groups


def _nbytes(item: WriteItem) -> int:
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def header(items: list[WriteItem], version: str) -> tuple[bytes, list[tuple[WriteItem, int, int]]]:
    """The file's first bytes (length, JSON, padded to 8 as safetensors does) and each item's data range.
    Items go in falling element size, as safetensors orders them, so every tensor's bytes stay aligned."""
    order = sorted(items, key=lambda it: (-it.tensor_data.properties.dtype.itemsize, it.index.fqn))
    entries: dict[str, Any] = {}
    sharding, ranges, at = {}, [], 0
    for item in order:
        dtype, sizes = item.tensor_data.properties.dtype, list(item.tensor_data.chunk.sizes)
        if dtype not in _DTYPES:
            raise TypeError(f"{item.index.fqn}: the checkpoint writer has no safetensors name for {dtype}")
        if item.index.fqn in entries:  # a file's header holds one entry per name (torch's writer: the same)
            raise ValueError(f"{item.index.fqn}: two chunks of one tensor on one rank")
        n = _nbytes(item)
        entries[item.index.fqn] = {"dtype": _DTYPES[dtype], "shape": sizes, "data_offsets": [at, at + n]}
        sharding[item.index.fqn] = {OFFSETS_KEY: list(item.tensor_data.chunk.offsets)}
        ranges.append((item, at, n))
        at += n
    meta = {SHARDING_KEY: json.dumps(sharding), VERSION_KEY: version, "format": "pt"}
    text = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, ranges


# torch's own is not enough: it serialises a rank's whole file in memory before writing it, as one file (above)
class StreamingHFWriter(HuggingFaceStorageWriter):
    """HuggingFaceStorageWriter whose `write_data` streams (module docstring): everything else — plans, the
    shard index in each rank's file names, `finish`, async staging — is torch's."""

    def __init__(self, path: str, save_distributed: bool, threads: int = 1) -> None:
        super().__init__(path, save_distributed=save_distributed)
        self.threads = max(1, threads)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:  # torch's HF writer would corrupt the file with it too
                raise TypeError(f"{item.index.fqn}: only tensors go into a safetensors checkpoint")
        # torch's prepare_global_plan numbers the ranks' plans (save_distributed); test_ckpt_writer checks the names
        shard = (plan.storage_data or {}).get("shard_index")
        groups = split_by_size(plan.items, self.threads) if plan.items else []
        jobs = [(file_name(i, len(groups), shard), group) for i, group in enumerate(groups, start=1)]
        if len(jobs) <= 1:
            results = [self._write_file(name, group, planner) for name, group in jobs]
        else:
            with ThreadPoolExecutor(len(jobs), thread_name_prefix="loom-ckpt-write") as pool:
                results = list(pool.map(lambda job: self._write_file(*job, planner), jobs))
        fut: Future = Future()
        fut.set_result([r for rs in results for r in rs])
        return fut

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        head, ranges = header(items, "1.0")
        staging: _Staging | None = None
        results = []
        with open(os.path.join(self.path, name), "wb", buffering=0) as f:
            _write_all(f, memoryview(head))
            for item, offset, length in ranges:
                t = planner.resolve_data(item).detach()
                planned = (tuple(item.tensor_data.chunk.sizes), item.tensor_data.properties.dtype)
                if (tuple(t.shape), t.dtype) != planned:  # the header already promised these bytes
                    raise ValueError(f"{item.index.fqn}: planned {planned}, got {(tuple(t.shape), t.dtype)}")
                flat = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else None
                if flat is None:
                    pass
                elif t.device.type == "cpu" and not STAGE_CPU_TENSORS:
                    _write_all(f, memoryview(flat.numpy()))
                else:
                    if staging is None or staging.device != t.device:
                        staging = _Staging(t.device)
                    for part in staging.host_chunks(flat):
                        _write_all(f, part)
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=StoredItem(name, len(head) + offset, length)))
            os.fsync(f.fileno())  # as torch's writer does (sync_files): the file is on disk when the save returns
        return results


def _write_all(f, view: memoryview) -> None:
    """A raw file's `write` may take part of a buffer; writes of at most 1 GiB, until it has all of it."""
    view = view.cast("B")
    while len(view):
        n = f.write(view[: 1 << 30])
        view = view[n:]


class _Staging:
    """Two host buffers a thread copies a device tensor's bytes through, so the copy of chunk k+1 runs while
    chunk k is written (page-locked and on a side stream on CUDA; plain copies elsewhere)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        if self.cuda:  # a writer thread starts on GPU 0: pinning there would open a CUDA context on another rank's GPU
            torch.cuda.set_device(device)
        self.bufs = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.cuda:  # whatever stream wrote the tensors, they are final before a copy (sync saves only: async
            torch.cuda.synchronize(device)  # ones hand this writer host copies, so training never waits here)

    def host_chunks(self, flat: torch.Tensor) -> Iterator[memoryview]:
        """`flat`'s bytes in order, as views of the buffers; each is valid until the next is asked for."""
        if self.cuda:  # `.contiguous()` may just have written `flat` on this thread's stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        pending = None
        for k, start in enumerate(range(0, flat.numel(), CHUNK)):
            part = flat[start:start + CHUNK]
            host = self.bufs[k % 2][: part.numel()]  # the other buffer holds the chunk being written
            ready = self._copy(host, part)
            if pending is not None:
                yield self._view(*pending)
            pending = (host, ready)
        if pending is not None:
            yield self._view(*pending)

    def _copy(self, host: torch.Tensor, part: torch.Tensor):
        if not self.cuda:
            host.copy_(part)
            return None
        with torch.cuda.stream(self.stream):
            host.copy_(part, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    @staticmethod
    def _view(host: torch.Tensor, ready) -> memoryview:
        if ready is not None:
            ready.synchronize()
        return memoryview(host.numpy())
