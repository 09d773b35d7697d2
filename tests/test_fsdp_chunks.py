"""parallel/fsdp_chunks.py: FSDP2's per-parameter chunk list built lazily is torch's list, chunk for chunk, and a
`fully_shard` at a fake dp of 8,192 gives bitwise torch's shards, padding and DTensor specs while building O(1)
chunks a parameter instead of 8,192."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty as torch_chunk_with_empty

import loom.parallel.fsdp  # noqa: F401  (installs the lazy chunks, as a job's start-up does)
from loom.parallel.fsdp_chunks import LazyChunks, lazy_chunk_with_empty

ROOT = Path(__file__).resolve().parent.parent


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
            and a.dtype == b.dtype and a.device == b.device
            and (a.is_meta or a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()))


def test_fsdp_reads_the_lazy_chunks():
    assert _fsdp_param._chunk_with_empty is lazy_chunk_with_empty


def test_every_chunk_is_torchs_view():
    """Sizes that divide, that don't, fewer elements than chunks, empty dims; every dim, meta and CPU."""
    for shape in [(1,), (5,), (7, 3), (3, 0), (0, 4), (16, 8), (13, 5, 2)]:
        for device in ("cpu", "meta"):
            t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32, device=device).reshape(shape)
            for dim in range(-len(shape), len(shape)):
                for n in (1, 2, 3, 8, 33):
                    want, got = torch_chunk_with_empty(t, n, dim), LazyChunks(t, n, dim)
                    assert len(got) == len(want) == n
                    for i in [*range(n), -1, -n]:
                        assert _same_view(got[i], want[i]), (shape, device, dim, n, i, got[i].shape, want[i].shape)
                        assert device == "meta" or torch.equal(got[i], want[i])


def test_fully_shard_at_dp_8192_is_torchs_bitwise():
    """A fresh process per rank (fake backend, world 8,192): rank 0, a middle rank and one past every non-empty
    chunk shard the same module with torch's chunks and with loom's; every FSDPParam's shard, its padded data,
    sizes and DTensor spec match, and loom's path calls `new_empty` a handful of times, torch's ~8,192 a parameter."""
    script = textwrap.dedent("""
        import sys
        import torch, torch.nn as nn, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.fsdp._fully_shard import _fsdp_param
        from torch.testing._internal.distributed.fake_pg import FakeStore
        import loom.parallel.fsdp  # installs the lazy chunks
        from loom.parallel.fsdp_chunks import lazy_chunk_with_empty

        rank, world = int(sys.argv[1]), 8192
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))

        def sharded(chunks):
            _fsdp_param._chunk_with_empty = chunks
            torch.manual_seed(0)
            model = nn.Sequential(nn.Embedding(10000, 24), nn.Linear(24, 37), nn.LayerNorm(37), nn.Linear(37, 3))
            made = []
            new_empty = torch.Tensor.new_empty
            torch.Tensor.new_empty = lambda t, *a, **k: made.append(1) or new_empty(t, *a, **k)
            try:
                fully_shard(model[1], mesh=mesh, reshard_after_forward=8)  # also post-forward sizes
                fully_shard(model, mesh=mesh)
            finally:
                torch.Tensor.new_empty = new_empty
            states = [model._get_fsdp_state(), model[1]._get_fsdp_state()]
            return [p for s in states for p in s._fsdp_param_group.fsdp_params], len(made)

        theirs, torch_made = sharded(lazy_chunk_with_empty.torch_chunk_with_empty)
        ours, loom_made = sharded(lazy_chunk_with_empty)
        assert len(ours) == len(theirs) == 7
        for a, b in zip(ours, theirs):
            for name in ("sharded_size", "padded_sharded_param_size", "contiguous_sharded_stride", "_orig_size",
                         "sharded_post_forward_size"):
                assert getattr(a, name, None) == getattr(b, name, None), (name, getattr(a, name, None))
            la, lb = a.sharded_param._local_tensor, b.sharded_param._local_tensor
            assert la.shape == lb.shape and la.stride() == lb.stride() and torch.equal(la, lb)
            assert torch.equal(a._sharded_param_data, b._sharded_param_data)  # the padding too
            assert a.sharded_param._spec == b.sharded_param._spec and a._sharding_spec == b._sharding_spec
        assert torch_made >= 7 * 8000 and loom_made <= 16, (torch_made, loom_made)
        dist.destroy_process_group()
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for rank in (0, 4000, 8191):
        run = subprocess.run([sys.executable, "-c", script, str(rank)], cwd=ROOT, capture_output=True, text=True,
                             timeout=180, env=env)
        assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]
