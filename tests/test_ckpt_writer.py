"""loom's streaming checkpoint writer (loom/checkpoint/writer.py) writes what torch's HuggingFaceStorageWriter
wrote: every file valid safetensors with the same DCP header fields, every tensor equal, loadable under another
layout and world size; a rank's shards span several files when it has several threads."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

from loom.checkpoint import writer as streaming
from loom.checkpoint.sharded import read_one, saved_metadata
from loom.checkpoint.writer import StreamingHFWriter


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w.big": torch.randn(300, 70, generator=g), "w.half": torch.randn(33, generator=g).to(torch.bfloat16),
            "w.fp16": torch.randn(5, 3, generator=g).half(), "step": torch.tensor(7.0),
            "ids": torch.arange(11), "empty": torch.zeros(0, 4), "flags": torch.tensor([True, False, True]),
            "wide": torch.randn(40, 90, generator=g)}


def _save(state, path: Path, new: bool, threads: int = 3) -> None:
    w = StreamingHFWriter(str(path), save_distributed=False, threads=threads) if new else \
        HuggingFaceStorageWriter(str(path))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=w, no_dist=True)


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("*.safetensors"))


def _headers(path: Path) -> dict[str, dict]:
    """Every tensor's header entry, by name, over the folder's files; and each file's metadata."""
    out = {}
    for f in _files(path):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        head = json.loads(raw[8:8 + n])
        assert (8 + n) % 8 == 0 and len(raw) == 8 + n + max(e["data_offsets"][1] for k, e in head.items()
                                                             if k != "__metadata__")
        out.update({k: e for k, e in head.items() if k != "__metadata__"})
    return out


def test_streamed_files_are_safetensors_holding_what_torchs_writer_wrote(tmp_path):
    state = _state()
    _save(state, tmp_path / "torch", new=False)
    _save(state, tmp_path / "loom", new=True)
    assert [f.name for f in _files(tmp_path / "torch")] == ["model-00001-of-00001.safetensors"]
    assert [f.name for f in _files(tmp_path / "loom")] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    seen = {}
    for f in _files(tmp_path / "loom"):  # safetensors itself reads every tensor of every file
        with safe_open(str(f), framework="pt") as sf:
            meta = sf.metadata()
            assert set(meta) == {"format", "DCP_VERSION", "DCP_SHARDING_INFO"} and meta["DCP_VERSION"] == "1.0"
            sharding = json.loads(meta["DCP_SHARDING_INFO"])
            for k in sf.keys():
                seen[k] = sf.get_tensor(k)
                assert sharding[k] == {"saved_offsets": [0] * state[k].dim()}
    assert set(seen) == set(state) and all(torch.equal(seen[k], state[k]) for k in state)
    # the same header entries (dtype, shape) and the same DCP metadata as torch's writer's
    ours, theirs = _headers(tmp_path / "loom"), _headers(tmp_path / "torch")
    assert {k: (e["dtype"], e["shape"]) for k, e in ours.items()} == \
           {k: (e["dtype"], e["shape"]) for k, e in theirs.items()}
    assert saved_metadata(tmp_path / "loom") == saved_metadata(tmp_path / "torch")
    with safe_open(str(_files(tmp_path / "torch")[0]), framework="pt") as sf:
        assert set(sf.metadata()) == {"format", "DCP_VERSION", "DCP_SHARDING_INFO"}
    # loaded back through DCP's reader, several threads
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(back, storage_reader=HuggingFaceStorageReader(str(tmp_path / "loom"), thread_count=3), no_dist=True)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_one_thread_writes_one_file_and_a_non_contiguous_tensor_is_written_as_its_values(tmp_path):
    state = {"t": torch.randn(20, 30).t(), "u": torch.randn(4, 6)[:, ::2]}
    _save(state, tmp_path, new=True, threads=1)
    assert [f.name for f in _files(tmp_path)] == ["model-00001-of-00001.safetensors"]
    meta = saved_metadata(tmp_path)
    assert all(torch.equal(read_one(tmp_path, k, meta[k]), v) for k, v in state.items())


def test_the_staging_path_writes_the_same_bytes_in_chunks(tmp_path, monkeypatch):
    """The GPU path's logic (two buffers, chunk k+1 copied while chunk k is written) on CPU, with chunks
    smaller than the tensors: byte for byte the files the direct path writes."""
    state = _state()
    _save(state, tmp_path / "direct", new=True)
    monkeypatch.setattr(streaming, "STAGE_CPU_TENSORS", True)
    monkeypatch.setattr(streaming, "CHUNK", 1000)  # not a multiple of 4: a float can straddle two chunks
    _save(state, tmp_path / "staged", new=True)
    direct, staged = _files(tmp_path / "direct"), _files(tmp_path / "staged")
    assert [f.name for f in direct] == [f.name for f in staged]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(direct, staged))


def test_split_by_size_balances_bytes_and_never_leaves_a_file_empty():
    state = {f"t{i}": torch.zeros(n) for i, n in enumerate([100, 60, 50, 40, 10])}
    plan = dcp.default_planner.DefaultSavePlanner()
    plan.set_up_planner(state, is_coordinator=True)
    items = plan.create_local_plan().items
    groups = streaming.split_by_size(items, 2)  # 400, 240, 200, 160, 40 bytes, each to the lighter file
    assert sorted(sum(streaming._nbytes(i) for i in g) for g in groups) == [480, 560]
    assert sorted(i.index.fqn for g in groups for i in g) == sorted(state)
    assert len(streaming.split_by_size(items[:2], 8)) == 2 and len(streaming.split_by_size(items, 1)) == 1


def _global(rows: int = 12, cols: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"a": torch.randn(rows, cols, generator=g), "b": torch.randn(rows, generator=g).to(torch.bfloat16),
            "c": torch.randn(3, 3, generator=g)}


def _save_sharded_on_each_rank(root: str) -> list[str]:
    """On 2 gloo ranks: `a` and `b` sharded by rows, `c` whole on both; saved by both writers."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = _global()
    state = {"a": distribute_tensor(full["a"], mesh, [Shard(0)]), "b": distribute_tensor(full["b"], mesh, [Shard(0)]),
             "c": full["c"]}
    dcp.save(state, storage_writer=StreamingHFWriter(f"{root}/loom", save_distributed=True, threads=2))
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(f"{root}/torch", save_distributed=True))
    return sorted(p.name for p in Path(root, "loom").glob("*.safetensors"))


def _load_by_columns(path: str) -> bool:
    """On 2 gloo ranks: the checkpoint loaded into `a` sharded by columns, `b` and `c` whole."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = _global()
    state = {"a": distribute_tensor(torch.zeros_like(full["a"]), mesh, [Shard(1)]),
             "b": distribute_tensor(torch.zeros_like(full["b"]), mesh, [Replicate()]), "c": torch.zeros(3, 3)}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(path, thread_count=2))
    return all(torch.equal(state[k].full_tensor() if k != "c" else state[k], full[k]) for k in full)


def test_sharded_saves_span_several_files_per_rank_and_load_under_another_layout_and_world(worlds, tmp_path):
    names = worlds.run(2, _save_sharded_on_each_rank, str(tmp_path), timeout=120)
    # each rank its own shard index (torch's HF writer's plan names it) and 2 files of its own
    assert names[0] == names[1] == [f"shard-0000{r}-model-0000{i}-of-00002.safetensors" for r in (1, 2)
                                    for i in (1, 2)]
    ours, theirs = saved_metadata(tmp_path / "loom"), saved_metadata(tmp_path / "torch")
    assert {k: (m.size, m.properties.dtype, sorted(tuple(c.offsets) for c in m.chunks)) for k, m in ours.items()} \
        == {k: (m.size, m.properties.dtype, sorted(tuple(c.offsets) for c in m.chunks)) for k, m in theirs.items()}
    full = _global()
    for k, v in full.items():  # one process (another world size): each tensor whole, from either folder
        assert torch.equal(read_one(tmp_path / "loom", k, ours[k]), v)
        assert torch.equal(read_one(tmp_path / "loom", k, ours[k]), read_one(tmp_path / "torch", k, theirs[k]))
    assert worlds.run(2, _load_by_columns, str(tmp_path / "loom"), timeout=120) == [True, True]


def test_a_non_tensor_item_is_refused(tmp_path):
    import io

    with pytest.raises(dcp.api.CheckpointException) as e:  # DCP wraps each rank's error
        _save({"blob": io.BytesIO(b"abc"), "t": torch.ones(2)}, tmp_path, new=True)
    assert "blob: only tensors go into a safetensors checkpoint" in str(e.value.failures)
