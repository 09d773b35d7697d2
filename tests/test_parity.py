"""Every layout equals the one-process reference: loss, grad norm and post-step weights of every module, over
3 optimizer steps with clipping active, on N gloo ranks — one layout for all modules (FSDP2 + TP/SP), and a
layout per module joined by the colocated bridge (fan-in, fan-out, a frozen encoder), context parallelism,
and per-block torch.compile against the eager reference.

The default vision + audio + text model and task mix are used (images of different sizes, clips of
different lengths in every batch). A directed test breaks the global token count and checks that
verify then fails, so the oracle itself can fail.
"""

from __future__ import annotations

import io

import pytest
import torch.distributed as dist
from rich.console import Console

from loom.config import load_config

TOLERANCE = 1e-5
BASE = ["--train.global_batch_size=16", "--data.train_size=2000"]
TP = ["--layout.vision.tp={t}", "--layout.audio.tp={t}", "--layout.language.tp={t}"]
SP = ["--layout.language.sequence_parallel=true"]
CP2 = ["--layout.language.cp=2", "--data.pad_to_multiple=4"]
COMPILE = ["--train.compile=true"]


def tp(t: int) -> list[str]:
    return [o.format(t=t) for o in TP]


def _verify(overrides: list[str], breakage: str | None = None) -> list[dict]:
    import loom.bridge.colocated as bridge
    import loom.train.verify as v

    setup, sum_over_context = v.setup_parallel, bridge._sum_over_context
    if breakage == "local token count":  # each replica divides by its own token count, not the global one
        def local_count(*args):
            plan = setup(*args)
            plan.comms.dp_group = None
            return plan

        v.setup_parallel = local_count
    elif breakage == "no cp sum in the bridge":  # the encoder sees only this cp rank's share of its gradient
        bridge._sum_over_context = lambda grad, group: grad
    try:
        cfg = load_config(None, BASE + overrides, world_size=dist.get_world_size())
        checks = v.verify(cfg, steps=3, tolerance=TOLERANCE, console=Console(file=io.StringIO()))
    finally:
        v.setup_parallel, bridge._sum_over_context = setup, sum_over_context
    return [
        {"passed": c.passed, "loss": c.loss_diff, "norm": c.grad_norm_diff, "weights": c.weight_diff,
         "ref_norm": c.ref_grad_norm, "clip": cfg.train.grad_clip}
        for c in checks
    ]


# (world size, overrides): dp ∈ {1, 2, 4, 8}, tp ∈ {1, 2, 4}, dp×tp ∈ {2×2, 4×2}, with and without SP
LAYOUTS = {
    "dp1": (1, []),
    "dp2": (2, []),
    "tp2": (2, tp(2)),
    "tp2-sp": (2, tp(2) + SP + ["--data.pad_to_multiple=2"]),
    "dp4": (4, []),
    "tp4": (4, tp(4) + ["--model.language.num_heads=8", "--model.language.num_kv_heads=4"]),
    "dp2xtp2": (4, tp(2)),
    "dp2xtp2-sp-bshd": (4, tp(2) + SP + ["--data.pad_to_multiple=2", "--data.format=bshd"]),
    "dp4-fsdp-units-of-3-blocks": (4, ["--parallel.blocks_per_unit=3"]),
    "dp8": (8, []),
    "dp4xtp2": (8, tp(2)),
    "dp4xtp2-sp": (8, tp(2) + SP + ["--data.pad_to_multiple=2"]),
    # a layout per module on the same ranks, joined by the colocated bridge
    "fan-in": (4, ["--layout.vision.tp=1", "--layout.language.tp=2"]),  # vision dp4 → LLM dp2
    "fan-out": (4, ["--layout.vision.tp=4"]),  # vision dp1 → LLM dp4
    "fan-in-frozen-vision": (4, ["--layout.vision.tp=1", "--layout.language.tp=2", "--train.vision.freeze=true"]),
    "vision-dp8-audio-tp2-llm-tp4": (8, ["--layout.vision.tp=1", "--layout.audio.tp=2", "--layout.language.tp=4",
                                         "--model.language.num_heads=8", "--model.language.num_kv_heads=4",
                                         "--layout.language.sequence_parallel=true", "--data.pad_to_multiple=4"]),
    # context parallelism for the LLM (encoders spread over its cp ranks: fan-in by default)
    "cp2": (2, CP2),
    "cp2-bshd": (2, CP2 + ["--data.format=bshd"]),
    "cp2xtp2-sp": (4, ["--layout.language.cp=2", "--layout.language.tp=2", "--data.pad_to_multiple=8"] + SP),
    "cp4": (4, ["--layout.language.cp=4", "--data.pad_to_multiple=8"]),
    "fan-in-vision-dp4-llm-cp2xdp2": (4, CP2 + ["--layout.vision.tp=1"]),
    "fan-out-vision-dp2-llm-cp2xdp4": (8, CP2 + ["--layout.vision.tp=4"]),
    # torch.compile per block (eager hooks of FSDP/TP around it; CP attention eager inside it)
    "compiled-dp1": (1, COMPILE),
    "compiled-fan-in-llm-tp2-sp": (4, COMPILE + ["--layout.vision.tp=1", "--layout.language.tp=2",
                                                 "--data.pad_to_multiple=2"] + SP),
    "compiled-cp2": (2, COMPILE + CP2),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_reference(worlds, name):
    world, overrides = LAYOUTS[name]
    per_rank = worlds.run(world, _verify, overrides, timeout=300)
    for rank, steps in enumerate(per_rank):
        assert len(steps) == 3
        for i, s in enumerate(steps):
            where = f"{name} rank {rank} step {i + 1}"
            assert s["ref_norm"] > s["clip"], f"{where}: clipping not active"
            assert s["loss"] <= TOLERANCE and s["norm"] <= TOLERANCE, f"{where}: {s}"
            assert set(s["weights"]) == {"vision", "audio", "language"}
            assert max(s["weights"].values()) <= TOLERANCE, f"{where}: {s['weights']}"
            assert s["passed"]


def test_verify_fails_when_the_token_count_is_not_global(worlds):
    per_rank = worlds.run(2, _verify, [], breakage="local token count", timeout=300)
    for steps in per_rank:
        assert not any(s["passed"] for s in steps)
        assert steps[0]["norm"] > 1e-2  # each replica's gradient is off by its share of the tokens


def test_without_the_cp_sum_in_the_bridge_backward_the_encoder_gradient_is_wrong(worlds):
    per_rank = worlds.run(2, _verify, CP2, breakage="no cp sum in the bridge", timeout=300)
    for steps in per_rank:
        assert not steps[0]["passed"]
        assert steps[0]["norm"] > 1e-3  # the encoders' part of the global gradient is missing pieces
        assert steps[0]["weights"]["language"] <= TOLERANCE  # the LLM itself is not affected at step 1
        assert max(steps[0]["weights"]["vision"], steps[0]["weights"]["audio"]) > 1e-4

