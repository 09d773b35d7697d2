"""The GPU benchmarks' small CPU form, so they cannot rot: run as a user would, through torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_cp_long_small_runs_on_two_cpu_ranks():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "bench/cp_long.py", "--cp", "2", "--seq", "256", "--small", "--steps", "1", "--warmup", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("{"))
    result = json.loads(line)
    assert result["cp"] == 2 and result["dp"] == 1 and result["tokens_per_s_per_gpu"] > 0
    assert result["loss"] > 0


def test_multimodal_table_small_runs_every_contender(tmp_path):
    """bench/run_mm.sh on 2 CPU ranks, --small: every row of the GPU table runs, and bench.table reads them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), "EXTRA": "--small", "SEQ": "256", "STEPS": "1",
           "COMPILED": "",  # compile's own CPU tests are elsewhere; here only that every row still runs
           "WARMUP": "1"}
    out = tmp_path / "mm.jsonl"
    run = subprocess.run(["bash", "bench/run_mm.sh", str(out), "2"], capture_output=True, text=True, timeout=900,
                         env=env)
    assert run.returncode == 0 and "failed" not in run.stderr, run.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 7
    assert {(r["system"], r["layout"], r["format"]) for r in rows} >= {
        ("loom", "homogeneous", "thd"), ("loom", "heterogeneous", "thd"), ("loom", "homogeneous", "bshd"),
        ("hf", "fsdp2", "bshd")}
    assert all(r["tokens_per_s_per_gpu"] > 0 and r["loss"] > 0 for r in rows)
    padded = [r for r in rows if r["format"] == "bshd" and r["system"] == "loom"]
    assert sorted(r["padding_fraction"] for r in padded)[0] < sorted(r["padding_fraction"] for r in padded)[1]
    table = subprocess.run([sys.executable, "-m", "bench.table", str(out)], capture_output=True, text=True, env=env)
    assert table.returncode == 0 and len(table.stdout.splitlines()) == 2 + len(rows)
