"""Compiled expert parallelism compiles nothing after its first step, whatever the routing does.

Under EP each rank receives a data-dependent number of tokens (parallel/experts.py). On 4 H200s (issue 49) ep4
and ep2 recompiled once in a timed step (a 2.1 s step): the compiled frame after the dispatch's host read held
the split sizes as Python ints, so its guards checked their values (static first, then automatic-dynamic
symbols with 0/1 specialisation and inductor's bounds, e.g. `s46 + s71 < 32767` from its sort). These runs
change the routing between steps — normal, then every token on EP rank 0 (rank 1 receives nothing), then
normal — and count the frames dynamo compiled after step 1, on 2 gloo ranks, ep2, aot_eager (the guards are
dynamo's whatever the backend), with both expert kernels: the GPU's (grouped GEMM, bf16) and the CPU's loop.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_job_overrides
from test_moe_parity import MOE
from test_recompiles import COMPILE, recompile_log

from loom.models.experts import grouped_mm

EP2 = [*COMPILE, "--layout.language.ep=2", "--model.language.router_bias=true",
       "--model.language.router_bias_update_rate=0", "--data.tokens_per_microbatch=256"]
SKEWED = {2}  # the steps whose tokens all go to experts 0 and 1 (EP rank 0's)


def _skew(model: torch.nn.Module, on: bool) -> None:
    from loom.models.router import Router

    for router in (m for m in model.modules() if isinstance(m, Router)):
        router.e_score_correction_bias[:2] = 100.0 if on else 0.0


def ep_compiled_run(out_dir: str, overrides: list[str], steps: int) -> dict:
    """`steps` compiled steps of the tiny MoE job: frames compiled after the first, the recompile reasons, and
    each step's busiest layer's max / mean expert load (the routing did change)."""
    from loom.job import load_config
    from loom.parallel.compile import compiled_frames
    from loom.train.trainer import Trainer

    with recompile_log() as reasons:
        cfg = load_config(None, tiny_job_overrides(out_dir, *MOE, *overrides), world_size=dist.get_world_size())
        trainer = Trainer(cfg)
        first, logged, loads = 0, 0, []
        for step in range(steps):
            with torch.no_grad():
                _skew(trainer.model, step in SKEWED)
            loads.append(max(trainer.train_step().expert_load.values()))
            if step == 0:
                first, logged = compiled_frames(), len(reasons)
        return {"recompiles": compiled_frames() - first, "reasons": reasons[logged:], "first": first, "loads": loads}


KERNELS = {
    "grouped-bf16": ["--model.language.expert_kernel=grouped", "--train.dtype=bf16"],
    "loop-fp32": ["--model.language.expert_kernel=loop"],
    # the exchange in 2 chunks (parallel/expert_chunks.py): the experts a compiled frame of their own, per chunk
    "grouped-bf16-chunks2": ["--model.language.expert_kernel=grouped", "--train.dtype=bf16",
                             "--parallel.ep_chunks=2"],
}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_compiled_ep_compiles_nothing_after_the_first_step(worlds, tmp_path, kernel):
    if kernel.startswith("grouped") and grouped_mm is None:
        pytest.skip("this torch has no grouped_mm")
    for rank, result in enumerate(worlds.run(2, ep_compiled_run, str(tmp_path), EP2 + KERNELS[kernel], 4,
                                             timeout=600)):
        assert result["first"] > 0, "nothing was compiled: the test would prove nothing"
        # skewed: every token on 2 of 8 experts, max / mean = 4; the others below it
        assert [load == 4.0 for load in result["loads"]] == [s in SKEWED for s in range(4)], result["loads"]
        assert result["recompiles"] == 0 and not result["reasons"], (rank, result["reasons"])
