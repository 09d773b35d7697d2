"""A mixture-of-experts job's checkpoints reshard exactly between expert-parallel degrees: saved under ep2
(4 ranks), resumed under ep2 (bit-identical: the run is deterministic on CPU), ep4 and one process (≤ 1e-6);
the routers' choice bias (a persistent buffer the load-balance update moves) travels with the weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_resume import _assert_continues, _losses, _one_process, _train

MOE = ["--model.language.num_experts=4", "--model.language.moe_intermediate_size=16",
       "--model.language.mlp_only_layers=[0]", "--model.language.router_bias_update_rate=0.01"]
EP2, EP4 = MOE + ["--layout.language.ep=2"], MOE + ["--layout.language.ep=4"]


@pytest.fixture(scope="module")
def ep2_run(worlds, tmp_path_factory):
    """3 steps under dp4 with ep2, a checkpoint after step 2."""
    out = tmp_path_factory.mktemp("ep2")
    worlds.run(4, _train, str(out), 3, 2, "", EP2, timeout=300)
    return out


def test_resume_under_ep2_is_bit_identical(worlds, ep2_run, tmp_path):
    assert worlds.run(4, _train, str(tmp_path), 3, 0, str(ep2_run / "step-2"), EP2, timeout=300) == [2] * 4
    _assert_continues(ep2_run, tmp_path, [3], exact=True)


def test_reshard_ep2_to_ep4_and_to_one_process(worlds, ep2_run, tmp_path):
    worlds.run(4, _train, str(tmp_path / "ep4"), 3, 0, str(ep2_run / "step-2"), EP4, timeout=300)
    _assert_continues(ep2_run, tmp_path / "ep4", [3], exact=False)
    assert _one_process(tmp_path / "one", 3, 0, str(ep2_run / "step-2"), MOE) == 2
    _assert_continues(ep2_run, tmp_path / "one", [3], exact=False)
    assert _losses(Path(ep2_run))[1] != _losses(Path(ep2_run))[3]  # training moved: the comparison means something
    # each sparse layer's max / mean load, from whole-step counts: 4 ranks (gathered to rank 0) report what one
    # process does
    loads = [_expert_loads(d)[3] for d in (ep2_run, tmp_path / "ep4", tmp_path / "one")]
    assert loads[0] == loads[1] == loads[2] and loads[0]["expert_load/1"] >= 1.0, loads


def _expert_loads(out_dir: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("expert_load/")} for r in rows
            if r["kind"] == "train"}


def test_the_router_bias_is_restored(ep2_run, tmp_path):
    """Two updates of ±0.01 moved it; a resumed run starts from exactly the saved values, not from zeros."""
    from safetensors import safe_open
    from test_resume import _job

    from loom.job import load_config
    from loom.train.trainer import Trainer

    trainer = Trainer(load_config(None, _job(tmp_path, 3, 0, str(ep2_run / "step-2"), MOE)))
    bias = trainer.model.language.layers["1"].mlp.gate.e_score_correction_bias
    name = "model.language.layers.1.mlp.gate.e_score_correction_bias"
    saved = next(safe_open(f, "pt").get_tensor(name) for f in sorted((ep2_run / "step-2").glob("shard-*"))
                 if name in safe_open(f, "pt").keys())
    assert bias.abs().max() > 0.015 and bias.equal(saved)
