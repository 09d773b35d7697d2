"""The private torch APIs loom keeps (docs/architecture.md, "Private torch APIs kept": each with its reason), pinned:
each test fails on a torch that drops or changes what loom reads or writes, before a job meets it mid-run.

Public ones used in a way a reader may not expect (a block's `forward` wrapped in place by parallel/compile.py and
parallel/checkpointing.py) are covered by the compile and checkpointing tests, not here.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

ROOT = Path(__file__).resolve().parent.parent


def test_device_mesh_private_constructor_and_layout():
    """topology/grid.py `flat_mesh`: a flattened mesh under the grid's root over the registry's group."""
    from torch.distributed._mesh_layout import _MeshLayout

    params = inspect.signature(DeviceMesh.__init__).parameters
    assert {"_layout", "_rank_map", "_root_mesh", "_init_backend"} <= set(params), sorted(params)
    assert hasattr(_MeshLayout, "collapse") or all(hasattr(_MeshLayout, m) for m in ("coalesce", "nest"))


def test_meshes_share_one_rank_map_tuple():
    """topology/rank_maps.py rewrites `DeviceMesh._flatten_rank_map` (the root's rank map as a tuple, which torch
    builds anew in every mesh's __init__): torch still sets it there, as the rank map's values, and with loom's
    wrapper a root, its slices and their concatenation hold one tuple. A fake 8-rank world, dp4·tp2."""
    script = textwrap.dedent("""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from loom.topology.grid import Grid
        from loom.topology.groups import GroupRegistry
        from loom.topology.layout import Layout
        from loom.topology.rank_maps import rank_map_copies

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        grid = Grid(Layout("language", 0, tp=2, dp=4))
        GroupRegistry().build([grid])
        root = grid.mesh("pp", "dp", "cp", "tp")
        meshes = [root, root["dp"], root["tp"], root["dp"], DeviceMesh._concatenate([root["dp"], root["tp"]])]
        assert root._flatten_rank_map == tuple(range(8)), root._flatten_rank_map
        assert rank_map_copies(meshes) == 1, [id(m._flatten_rank_map) for m in meshes]
        DeviceMesh.__init__ = DeviceMesh.__init__.__wrapped__  # torch's own: a tuple per mesh (what loom undoes)
        assert rank_map_copies([root, root["dp"], root["tp"]]) == 3
        dist.destroy_process_group()
        print("ok")
    """)
    _runs_ok(script)


def test_flat_mesh_is_the_one_torch_flattens_to_over_the_registry_group():
    """The same, run: a fake 8-rank world (rank 0), dp2·cp2·tp2. The flattened dp×cp mesh hangs off the grid's
    root (torch's own `_flatten` returns it), holds the registry's group and no other, and slices like torch's."""
    script = textwrap.dedent("""
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from loom.topology.grid import Grid
        from loom.topology.groups import GroupRegistry
        from loom.topology.layout import Layout

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        grid = Grid(Layout("language", 0, tp=2, cp=2, dp=2))
        GroupRegistry().build([grid])
        flat = grid.flat_mesh("dp", "cp")
        root = grid.mesh("pp", "dp", "cp", "tp")
        assert flat.mesh_dim_names == ("dp_cp",) and flat.mesh.tolist() == [0, 2, 4, 6], flat
        assert flat.get_group() is grid.group("dp", "cp")
        assert root["dp", "cp"]._flatten("dp_cp") is flat  # torch finds it where flat_mesh put it
        assert flat._get_root_mesh() is root if hasattr(flat, "_get_root_mesh") else flat._root_mesh is root
        assert root._pg_registry[grid.group("dp", "cp").group_name] is grid.group("dp", "cp")
        dist.destroy_process_group()
        print("ok")
    """)
    _runs_ok(script)


def test_fsdp_param_reads_two_chunks_of_chunk_with_empty():
    """parallel/fsdp_chunks.py replaces the `_chunk_with_empty(tensor, num_chunks, dim)` that `FSDPParam` looks up
    in its module with a lazy list: torch still calls it there, and reads its result only by index (this rank's
    chunk, the padded 0th), so building the chunks read is enough — a loop or `len` would make it O(dp) again."""
    import re

    from torch.distributed.fsdp._fully_shard import _fsdp_param

    from loom.parallel.fsdp_chunks import chunk_lazily, lazy_chunk_with_empty

    assert chunk_lazily() and _fsdp_param._chunk_with_empty is lazy_chunk_with_empty
    torch_chunks = lazy_chunk_with_empty.torch_chunk_with_empty
    assert list(inspect.signature(torch_chunks).parameters) == ["tensor", "num_chunks", "dim"]
    source = inspect.getsource(_fsdp_param.FSDPParam)
    assert source.count("= _chunk_with_empty(") >= 2, "FSDPParam no longer chunks through _chunk_with_empty"
    reads = re.findall(r"\bchunks\b(.{0,30})", source)
    assert all(r.startswith((" = _chunk_with_empty(", "[")) for r in reads), reads
    assert set(re.findall(r"\bchunks\[([^\]]+)\]", source)) <= {"0", "shard_rank", "mesh_info.shard_mesh_rank"}


def test_fsdp_param_shard_mesh_is_a_function_of_its_mesh():
    """parallel/fsdp_shard_mesh.py keeps `FSDPParam._init_shard_mesh`'s result on the mesh it sliced and hands it to
    every later parameter over that mesh: torch still calls it (self only) once in `_init_sharded_param`, computes
    it from `self.mesh_info.mesh` alone, and never reassigns `_shard_mesh` — so one slice serves every parameter."""
    import re

    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    from loom.parallel.fsdp_shard_mesh import share_shard_meshes

    assert share_shard_meshes() and FSDPParam._init_shard_mesh.loom_shares_shard_mesh
    torch_init = FSDPParam._init_shard_mesh.__wrapped__
    assert list(inspect.signature(torch_init).parameters) == ["self"]
    body = inspect.getsource(torch_init)
    assert set(re.findall(r"\bself\.[\w.]+", body)) == {"self.mesh_info.mesh"}, body
    source = inspect.getsource(FSDPParam)
    assert source.count("self._shard_mesh = ") == 1 and "self._shard_mesh = self._init_shard_mesh()" in source


def test_pipeline_stage_methods_loom_overrides():
    """parallel/pipeline.py: RowsAwareStage and ShardedGradStage override these undocumented PipelineStage
    methods (stage 0's backward notice; FSDP2's per-microbatch reduce) and call `stage_backward`."""
    from torch.distributed.pipelining._backward import stage_backward

    want = {
        "backward_one_chunk": ["bwd_chunk_id", "loss", "full_backward", "last_backward"],
        "backward_weight_one_chunk": ["bwd_chunk_id", "last_backward"],
        "backward_maybe_with_nosync": ["backward_type", "bwd_kwargs", "last_backward"],
    }
    for name, args in want.items():
        params = list(inspect.signature(getattr(PipelineStage, name)).parameters)[1:]
        assert params[: len(args)] == args, (name, params)
    assert list(inspect.signature(stage_backward).parameters)[:3] == ["stage_output", "output_grads", "input_values"]
    # what the overrides read of the stage: its module, index and whether this run has a backward
    assert isinstance(inspect.getattr_static(PipelineStage, "has_backward"), property)
    init = inspect.getsource(inspect.getmro(PipelineStage)[1].__init__)
    assert "self.submod = " in init and "self.stage_index = " in init


def test_current_graph_task_id_tells_a_recomputation():
    """models/moe.py `_count_routed`: -1 outside backward; not -1 inside it (checkpoint's recomputation)."""
    assert torch._C._current_graph_task_id() == -1
    seen = []
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda g: seen.append(torch._C._current_graph_task_id()) or g)
    (x * 2).sum().backward()
    assert seen and seen[0] != -1


def test_local_shape_and_offset_of_a_shard():
    """parallel/materialize.py, train/token_stats.py: this rank's box of a DTensor (DCP's planner uses it too)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    params = list(inspect.signature(compute_local_shape_and_global_offset).parameters)
    assert params[:3] == ["global_shape", "mesh", "placements"], params


def test_dynamo_lru_cache_switch():
    """parallel/checkpointing.py: compiled blocks under checkpointing look their graphs up in insertion order."""
    from torch._C._dynamo import eval_frame

    assert callable(eval_frame._set_lru_cache)


def _runs_ok(script: str) -> None:
    """`script` in a fresh process (a fake world of its own), which prints "ok" last."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]
