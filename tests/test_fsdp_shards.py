"""FSDP2 under LLM cp shards over dp × cp: at dp2·cp2 on 4 gloo ranks each LLM parameter's local shard holds
1/4 of its rows (torch.chunk's split over the 4 ranks), and under the bench's HSDP layout (before dp×cp
flattening; bench/cp_long.py --fsdp hsdp) 1/2 of them, the same on both dp replicas."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loom.job import load_config
from loom.data.tokenizer import ByteTokenizer

CP2_ON_4 = ["--layout.language.cp=2", "--data.pad_to_multiple=4", "--train.global_batch_size=8"]


def _local_rows(hsdp: bool) -> dict[str, tuple[int, int]]:
    """Every LLM parameter: (rows of the whole weight, rows of this rank's shard)."""
    import torch

    import loom.parallel.fsdp
    from bench.cp_long import replicate_over_dp
    from loom.train.build import build_job_model, setup_parallel

    cfg = load_config(None, CP2_ON_4, world_size=dist.get_world_size())
    original = loom.parallel.fsdp.fsdp_mesh
    try:
        if hsdp:
            replicate_over_dp()
        model = build_job_model(cfg, ByteTokenizer())
        setup_parallel(model, cfg, torch.device("cpu"))
    finally:
        loom.parallel.fsdp.fsdp_mesh = original
    out = {}
    for name, p in model.language.named_parameters():
        assert isinstance(p, DTensor), name
        out[name] = (p.shape[0], p.to_local().shape[0])
    return out


def _chunk_rows(rows: int, parts: int, index: int) -> int:
    """Rows of chunk `index` when torch.chunk cuts `rows` into `parts`: ceil-sized chunks, the last ones short."""
    size = -(-rows // parts)
    return max(0, min(size, rows - index * size))


def test_llm_shards_over_dp_times_cp(worlds):
    per_rank = worlds.run(4, _local_rows, False)
    # dp2·cp2·tp1 on ranks 0-3: rank = 2·dp + cp, so the flattened dp×cp index is the rank itself
    for rank, shards in enumerate(per_rank):
        assert shards, "no LLM parameter"
        for name, (rows, local) in shards.items():
            assert local == _chunk_rows(rows, 4, rank), (rank, name, rows, local)
    for name in per_rank[0]:
        assert sum(shards[name][1] for shards in per_rank) == per_rank[0][name][0]  # every row once


def test_bench_hsdp_layout_shards_over_cp_only(worlds):
    per_rank = worlds.run(4, _local_rows, True)
    for rank, shards in enumerate(per_rank):
        cp = rank % 2
        for name, (rows, local) in shards.items():
            assert local == _chunk_rows(rows, 2, cp), (rank, name, rows, local)


def _gathered_after_forward(frozen: bool) -> list[str]:
    """The vision encoder's parameters still gathered (not DTensor shards) after a forward with no backward, at
    dp2 with the encoder frozen or trained."""
    import torch

    from loom.train.build import build_job_model, setup_parallel

    cfg = load_config(None, ["--train.global_batch_size=8", f"--train.vision.freeze={str(frozen).lower()}"],
                      world_size=dist.get_world_size())
    model = build_job_model(cfg, ByteTokenizer())
    setup_parallel(model, cfg, torch.device("cpu"))
    with torch.no_grad():
        model.encode({"vision": [torch.randn(3, 32, 32)]})
    return [name for name, p in model.vision.named_parameters() if not isinstance(p, DTensor)]


def test_a_frozen_encoder_reshards_after_its_forward(worlds):
    """A frozen module has no backward for FSDP2 to reshard it in: every unit, its root too, reshards after forward
    (a trained one's root keeps its weights gathered for the backward that follows)."""
    frozen, trained = worlds.run(2, _gathered_after_forward, True), worlds.run(2, _gathered_after_forward, False)
    assert frozen == [[], []]
    assert all(trained) and trained[0] == trained[1]  # the root's own weights, kept for the backward


def _units_and_prefetch(overrides: list[str]) -> dict[str, list]:
    """Per module: each FSDP2 unit's blocks, whether it reshards after forward, and the units its forward and
    backward prefetch (FSDP2 keeps these on its private state; its public API only sets them)."""
    import torch

    from loom.parallel.blocks import transformer_blocks
    from loom.train.build import build_job_model, setup_parallel

    cfg = load_config(None, ["--train.global_batch_size=8", *overrides], world_size=dist.get_world_size())
    model = build_job_model(cfg, ByteTokenizer())
    setup_parallel(model, cfg, torch.device("cpu"))
    out = {}
    for name in ("vision", "language"):
        blocks = transformer_blocks(name, model.get_submodule(name))
        index = {id(b._get_fsdp_state()): i for i, b in reversed(list(enumerate(blocks)))}  # a unit's first block
        units = sorted(set(index.values()))
        out[name] = [(i, blocks[i]._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None,
                      [index[id(s)] for s in blocks[i]._get_fsdp_state()._states_to_forward_prefetch],
                      [index[id(s)] for s in blocks[i]._get_fsdp_state()._states_to_backward_prefetch])
                     for i in units]
    return out


def test_units_prefetch_ahead_and_the_last_keeps_its_weights(worlds):
    """Unit i gathers unit i+1 (forward) and i−1 (backward) ahead; with reshard_after_forward every unit
    reshards after forward but the last, whose backward comes right after its forward; without it (the default)
    none does. The LLM has 4 blocks, the ViT 2 and the audio encoder 2 (configs' defaults): an encoder's units
    are a third of its blocks by default, so one block each here."""
    per_rank = worlds.run(2, _units_and_prefetch, ["--parallel.reshard_after_forward=true"])
    assert per_rank[0]["language"] == [(0, True, [1], []), (1, True, [2], [0]), (2, True, [3], [1]),
                                       (3, False, [], [2])]
    assert per_rank[0]["vision"] == [(0, True, [1], []), (1, False, [], [0])]
    kept = worlds.run(2, _units_and_prefetch, [])
    assert kept[0]["language"] == [(0, False, [1], []), (1, False, [2], [0]), (2, False, [3], [1]),
                                   (3, False, [], [2])]
    two = worlds.run(2, _units_and_prefetch, ["--parallel.fsdp_prefetch=2", "--parallel.reshard_after_forward=true",
                                              "--parallel.module_blocks_per_unit.language=2",
                                              "--model.vision.num_layers=7"])
    assert two[0]["language"] == [(0, True, [2], []), (2, False, [], [0])]  # units of 2 blocks: 0-1, 2-3
    assert two[0]["vision"] == [(0, True, [3, 6], []), (3, True, [6], [0]), (6, False, [], [3, 0])]  # ⌈7/3⌉ = 3
