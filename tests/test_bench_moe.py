"""bench/mm_bench.py's mixture-of-experts fields on CPU ranks, run as a user would, through torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.workload import SMALL, PackedSteps
from loom.job import load_config


def test_moe_row_reports_each_layers_expert_load_over_the_timed_steps():
    """bench/mm_bench.py --small --llm moe at ep2 on 2 CPU ranks: `expert_load` has every sparse layer, and each
    layer's counts (summed over both ranks, the warm-up step left out) add up to the timed steps' LLM tokens × k."""
    from bench.mm_bench import SMALL_MODEL, SMALL_MOE

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "bench/mm_bench.py",
           "--small", "--llm", "moe", "--seq", "256", "--per-gpu", "2", "--steps", "2", "--warmup", "1",
           "--set", "layout.language.ep=2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(next(text for text in out.stdout.splitlines() if text.startswith("{")))
    lm = load_config(None, SMALL_MODEL + SMALL_MOE).model.language
    workload = PackedSteps(SMALL, 2, 2, 256)
    routed = sum(len(s) for step in (1, 2) for s in workload.global_batch(step)) * lm.num_experts_per_tok
    load = row["expert_load"]
    assert sorted(load, key=int) == [str(i) for i in lm.sparse_layers], load
    for layer in load.values():
        counts = layer["counts"]
        assert len(counts) == lm.num_experts and sum(counts) == layer["routed"] == routed, (layer, routed)
        assert layer["max_over_mean"] == round(max(counts) * lm.num_experts / routed, 3)
        assert layer["busiest_share"] == round(max(counts) / routed, 4)
