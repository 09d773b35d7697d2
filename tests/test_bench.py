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


def test_multimodal_bench_small_runs_every_contender():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    for args in (["--system", "loom", "--layout", "heterogeneous"], ["--system", "loom", "--format", "bshd"],
                 ["--system", "hf"]):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "bench/mm_bench.py", *args, "--small", "--steps", "1", "--warmup", "1"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(next(l for l in out.stdout.splitlines() if l.startswith("{")))
        assert result["tokens_per_s_per_gpu"] > 0 and result["loss"] > 0
