"""Issue 51's workloads (bench/layout_workloads.py): every 4-GPU row and its `loom verify` config is one loom
accepts, with a step whose samples fit the row's bins (checked here, no process, so a GPU call does not find out);
each workload's CPU form runs through bench/run_layouts.sh on 2 gloo ranks, its loom row verified; the pipeline
bubble's accounting (bench/stage_timing.py) by hand."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from bench.layout_workloads import WORKLOADS, verify_overrides, workload_overrides
from bench.stage_timing import StageTiming
from bench.workload import PackedSteps
from loom.data.bins import assign_bins
from loom.job import load_config
from loom.topology import Topology
from loom.topology.checks import sample_multiple

ROWS = [(w.name, row) for w in WORKLOADS.values() for row in w.layouts]


@pytest.mark.parametrize("workload,row", ROWS)
def test_every_four_gpu_row_loads_and_its_samples_fit_its_bins(workload, row):
    w = WORKLOADS[workload]
    assert w.shape.longest * w.per_gpu <= w.seq  # else PackedSteps would redraw forever
    cfg = load_config(None, [*workload_overrides(workload, row, small=False), "--train.dtype=bf16",
                             f"--train.global_batch_size={4 * w.per_gpu}", "--data.train_size=1000000"], world_size=4)
    lay = Topology.plan(cfg, 4).placement.layouts["language"]
    multiple = sample_multiple(lay, cfg)
    assert -(-w.shape.longest // multiple) * multiple <= cfg.data.tokens_per_microbatch
    batch = PackedSteps(w.shape, 4, w.per_gpu, w.seq).global_batch(0)
    tokens = [-(-len(s) // multiple) * multiple for s in batch]
    assign_bins(tokens, [0] * len(tokens), lay.dp, cfg.train.microbatches, cfg.data.tokens_per_microbatch)
    if row.startswith("one-"):  # one layout: the encoder on the LLM's replicas
        assert Topology.plan(cfg, 4).placement.layouts["vision"].dp == lay.dp
    load_config("configs/tiny.toml", verify_overrides(workload, row, small=False), world_size=4)


def test_a_row_that_is_not_the_workloads_names_the_choices():
    with pytest.raises(ValueError, match=r"'loom-cp9' is not a row of workload 'long-context'.*loom-cp4"):
        workload_overrides("long-context", "loom-cp9", small=False)


# `loom verify` in CI for the pipelined workload's loom row only (the three-phase step under pp2): a verify costs ~17 s
# of CPU on 2 ranks; the others' loom layouts (cp2 fan-in, encoders on a rank of their own) are verified in
# tests/test_parity.py and tests/test_noncolocated.py, and every row's on the GPUs by run_layouts.sh
VERIFIED_IN_CI = {"pipelined": "loom"}


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_small_form_runs_every_row(workload, tmp_path):
    """bench/run_layouts.sh with SMALL=1: each row trains on 2 gloo ranks; the pipelined loom row passes verify."""
    verify = VERIFIED_IN_CI.get(workload, "0")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), "SMALL": "1", "VERIFY": verify}
    run = subprocess.run(["bash", "bench/run_layouts.sh", str(tmp_path), workload], capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + "".join(p.read_text()[-2000:] for p in tmp_path.glob("*.log"))
    lines = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    bench = [r for r in lines if "verify" not in r]
    assert [r["row"] for r in bench] == list(WORKLOADS[workload].small_layouts)
    assert all(r["workload"] == workload and r["tokens_per_s_per_gpu"] > 0 for r in bench)
    assert [(r["row"], r["verify"]) for r in lines if "verify" in r] == [
        (row, "passed") for row in WORKLOADS[workload].small_layouts if row.startswith("loom-") and verify == "loom"]
    if workload == "pipelined":  # --stage-timing: every stage ran each microbatch's forward and backward
        for r in bench:
            t = r["stage_timing"]
            assert t["ideal_bubble"] == 0.2 and set(t["bubble_per_rank"]) == {"0", "1"}
            assert all(c["forward_one_chunk"] == c["backward_one_chunk"] == 4 for c in t["chunks_per_step"].values())


class _Tick:
    def __init__(self, t):
        self.t = t

    def seconds_since(self, start):
        return self.t - start.t


def test_bubble_accounting_by_hand():
    """p = 2, m = 2: a rank busy 3 of its schedule's 4 seconds has a bubble of 1/4; the ideal is 1/3."""
    timing = StageTiming.__new__(StageTiming)
    timing.gpu, timing.p, timing.m, timing.schedule = False, 2, 2, "1f1b"
    timing.steps = [{"run": (_Tick(0), _Tick(4)),
                     "chunks": [("forward_one_chunk", _Tick(0), _Tick(1)), ("forward_one_chunk", _Tick(1), _Tick(2)),
                                ("backward_one_chunk", _Tick(2.5), _Tick(3.5))]}]
    report = timing.report()["stage_timing"]
    assert report["bubble_per_rank"] == {0: 0.25} and report["ideal_bubble"] == round(1 / 3, 4)
    assert report["bubble_over_ideal"] == pytest.approx(0.75, abs=1e-3)
