"""parallel/fsdp_shard_mesh.py: under HSDP at a fake world of 8,192, `fully_shard` slices the shard mesh once per
(replicate, shard) mesh instead of once per parameter, and its shards and DTensor specs are bitwise torch's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

import loom.parallel.fsdp  # noqa: F401  (installs the shared shard mesh, as a job's start-up does)

ROOT = Path(__file__).resolve().parent.parent


def test_fsdp_slices_through_the_shared_shard_mesh():
    assert getattr(FSDPParam._init_shard_mesh, "loom_shares_shard_mesh", False)


def test_hsdp_fully_shard_at_world_8192_slices_once_and_is_torchs_bitwise():
    """A fresh process (fake backend, world 8,192 as 1,024 replicas × 8 shards, rank 4,003): the same module is
    sharded with torch's `_init_shard_mesh` and with loom's. Every FSDPParam's local shard, padded data, sizes,
    DTensor spec and shard mesh match torch's (equal, same hash); loom builds one shard mesh for all 7 parameters
    of 2 `fully_shard` calls over one mesh, torch one per parameter."""
    script = textwrap.dedent("""
        import torch, torch.nn as nn, torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.testing._internal.distributed.fake_pg import FakeStore
        import loom.parallel.fsdp  # installs the shared shard mesh
        from loom.parallel.fsdp_shard_mesh import SHARD_MESH_ATTR

        dist.init_process_group("fake", store=FakeStore(), rank=4003, world_size=8192)
        loom_init = FSDPParam._init_shard_mesh
        torch_init = loom_init.__wrapped__

        def sharded(init_shard_mesh):
            FSDPParam._init_shard_mesh = init_shard_mesh
            mesh = init_device_mesh("cpu", (1024, 8), mesh_dim_names=("replicate", "shard"))
            torch.manual_seed(0)
            model = nn.Sequential(nn.Embedding(10000, 24), nn.Linear(24, 37), nn.LayerNorm(37), nn.Linear(37, 3))
            built = []
            mesh_init = DeviceMesh.__init__
            DeviceMesh.__init__ = lambda m, *a, **k: built.append(1) or mesh_init(m, *a, **k)
            try:
                fully_shard(model[1], mesh=mesh)
                fully_shard(model, mesh=mesh)
            finally:
                DeviceMesh.__init__ = mesh_init
            states = [model._get_fsdp_state(), model[1]._get_fsdp_state()]
            return [p for s in states for p in s._fsdp_param_group.fsdp_params], len(built), mesh

        theirs, torch_built, _ = sharded(torch_init)
        ours, loom_built, mesh = sharded(loom_init)
        assert len(ours) == len(theirs) == 7
        for a, b in zip(ours, theirs):
            for name in ("sharded_size", "padded_sharded_param_size", "contiguous_sharded_stride", "_orig_size"):
                assert getattr(a, name) == getattr(b, name), (name, getattr(a, name))
            la, lb = a.sharded_param._local_tensor, b.sharded_param._local_tensor
            assert la.shape == lb.shape and la.stride() == lb.stride() and torch.equal(la, lb)
            assert torch.equal(a._sharded_param_data, b._sharded_param_data)  # the padding too
            assert a.sharded_param._spec == b.sharded_param._spec and a._sharding_spec == b._sharding_spec
            assert hash(a.sharded_param._spec) == hash(b.sharded_param._spec)
            assert a.shard_mesh == b.shard_mesh and hash(a.shard_mesh) == hash(b.shard_mesh)
            assert a.shard_mesh.mesh.tolist() == list(range(4000, 4008)) and a.shard_mesh.get_local_rank() == 3
        assert torch_built >= 7 and loom_built <= 1, (torch_built, loom_built)
        assert len({id(p.shard_mesh) for p in ours}) == 1 and getattr(mesh, SHARD_MESH_ATTR) is ours[0].shard_mesh
        dist.destroy_process_group()
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]
