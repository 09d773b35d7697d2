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
