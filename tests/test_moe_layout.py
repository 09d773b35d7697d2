"""`[layout.language] ep`: checked before any group or weight exists, each error naming the key and the valid
values; `loom plan` shows each rank's EP place; the EP and efsdp rank sets are views of dp×cp."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from loom.job import load_config
from loom.parallel.experts import _arranged
from loom.topology import Topology
from loom.topology.plan import print_plan
from loom.typed_config import ConfigError

MOE = ["--model.language.num_experts=8", "--model.language.moe_intermediate_size=32"]


def plan(world: int, *overrides: str) -> Topology:
    return Topology.plan(load_config(None, list(overrides)), world)


@pytest.mark.parametrize("overrides, message", [
    (["--layout.language.ep=3"], "layout.language.ep = 3 does not divide model.language.num_experts = 8 "
                                 "(valid ep: [1, 2, 4])"),
    (["--layout.language.ep=8"], "layout.language.ep = 8 does not divide the LLM's dp·cp = 4·1 = 4 ranks it is a "
                                 "view of (valid ep: [1, 2, 4])"),
    (["--layout.language.ep=2", "--model.language.num_experts=0"], "layout.language.ep = 2 needs experts"),
    (["--layout.vision.ep=2"], "layout.vision.ep = 2: expert parallelism is for the LLM's experts"),
    (["--layout.language.ep=0"], "layout.language.ep = 0 must be ≥ 1"),
])
def test_bad_ep_is_named_before_anything_is_built(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan(4, *MOE, *overrides)


def test_ep_is_a_view_of_dp_x_cp_per_stage_and_tp_rank():
    """8 ranks, tp2·cp2·dp2: the dp×cp ranks of tp coordinate 0 are 0, 2, 4, 6 (cp fastest); ep2 cuts them into
    runs of 2, each one copy of all experts; efsdp takes the same place of each run."""
    topo = plan(8, *MOE, "--layout.language.tp=2", "--layout.language.cp=2", "--layout.language.ep=2",
                "--data.pad_to_multiple=4")
    ranks = _arranged(topo.grids["language"])  # [pp, efsdp, ep, tp]
    assert ranks[0, :, :, 0].tolist() == [[0, 2], [4, 6]]
    assert ranks[0, :, :, 1].tolist() == [[1, 3], [5, 7]]
    out = io.StringIO()
    print_plan(topo, Console(file=out, width=200))
    text = out.getvalue()
    assert "dp2 ep2" in text and "dp0 tp0 cp1 ep1" in text and "dp1 tp1 cp0 ep0" in text


def _ep_block_eager_and_compiled(skewed: bool) -> list[dict[str, float]]:
    """On each of 2 ranks: the same block twice, its experts split over ep 2 (parallel/experts.py), one block
    compiled (dynamo + AOTAutograd around the uneven all-to-alls); two batches of each rank's own tokens, routed
    differently (skewed: the first sends every token to rank 0's experts), so split sizes traced as constants
    would show. Per batch, the largest difference of output, input gradient and each local gradient."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from loom.models.moe import MoEBlock
    from loom.models.router import RouterSpec
    from loom.parallel.experts import ExpertParallel

    mesh = init_device_mesh("cpu", (2,))
    blocks = []
    for _ in range(2):
        torch.manual_seed(0)
        b = MoEBlock(16, RouterSpec(8, 2, "sigmoid", choice_bias=True), 8)
        with torch.no_grad():
            for p in b.parameters():
                p.normal_(0, 0.3)
        parallelize_module(b.experts, mesh, ExpertParallel())
        blocks.append(b)
    blocks[1].forward = torch.compile(blocks[1].forward, backend="aot_eager")
    diffs = []
    for batch in range(2):
        torch.manual_seed(10 * batch + dist.get_rank())
        x, g = torch.randn(12, 16), torch.randn(12, 16)
        bias = torch.tensor([50.0, 50.0] + [0.0] * 6) if skewed and batch == 0 else torch.zeros(8)
        results = []
        for b in blocks:
            b.gate.e_score_correction_bias.copy_(bias)  # selection only: experts 0 and 1 take every token
            b.zero_grad()
            xi = x.clone().requires_grad_()
            y = b(xi)
            y.backward(g)
            local = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for n, p in b.named_parameters()}
            results.append((y.detach(), xi.grad, local, b.tokens_per_expert.clone()))
        (y0, gx0, p0, c0), (y1, gx1, p1, c1) = results
        assert torch.equal(c0, c1) and (c0[2:].sum() == 0) == (skewed and batch == 0), (batch, c0, c1)
        diffs.append({"out": float((y0 - y1).abs().max()), "x_grad": float((gx0 - gx1).abs().max()),
                      **{n: float((p0[n] - p1[n]).abs().max()) for n in p0}})
    return diffs


@pytest.mark.parametrize("skewed", [False, True], ids=["routed", "skewed"])
def test_expert_parallel_block_compiles_to_the_same_output_and_gradients(worlds, skewed):
    """EP composes with compile: the compiled block's uneven all-to-alls give eager's output and gradients on
    every rank (eager EP equals one process: tests/test_moe_parity.py), also when one rank's experts get nothing."""
    for rank, batches in enumerate(worlds.run(2, _ep_block_eager_and_compiled, skewed, timeout=240)):
        for batch, diffs in enumerate(batches):
            assert max(diffs.values()) < 1e-6, f"rank {rank} batch {batch}: {diffs}"
