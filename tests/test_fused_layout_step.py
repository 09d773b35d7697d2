"""A layout's step with fused AdamW keeps the grad norm, the clip and the skip on the device (train/optim.py
`clip_in_optimizer` with a GradNormShare, `fused_step` through DTensors' local shards): the same verdicts as the
one-process reference, and the same skip on every rank. On GPUs AdamW is fused by default; here it is forced on
CPU (torch has a fused CPU kernel) so CI runs the path the GPUs take."""

from __future__ import annotations

import math

import pytest
from oracle import assert_all_passed, run_verify

FAN_IN_SP = ["--layout.vision.tp=1", "--layout.language.tp=2", "--layout.language.sequence_parallel=true",
             "--data.pad_to_multiple=2"]


def _verify_fused(overrides: list[str], steps: int) -> tuple[list[dict], int]:
    """run_verify with every AdamW fused (reference and layout); also how many steps took the device path."""
    import loom.train.optim as optim

    build, clip = optim.build_optimizer, optim.clip_in_optimizer
    calls = []

    def fused(module, cfg, lr_scale=1.0):
        opt = build(module, cfg, lr_scale)
        for group in opt.param_groups:  # before the first step: the state follows suit
            group.update(fused=True, foreach=None)
        return opt

    def counted(model, optimizer, max_norm, share=None):
        calls.append(share is not None)
        return clip(model, optimizer, max_norm, share)

    optim.build_optimizer = fused
    import loom.train.step as step

    step_clip, step.clip_in_optimizer = step.clip_in_optimizer, counted
    try:
        return run_verify(overrides, steps), sum(calls)
    finally:
        optim.build_optimizer, step.clip_in_optimizer = build, step_clip


@pytest.mark.parametrize("name,world,overrides", [
    ("dp2", 2, []),
    ("fan-in-llm-tp2-sp", 4, FAN_IN_SP),
])
def test_fused_layout_step_matches_reference(worlds, name, world, overrides):
    per_rank = worlds.run(world, _verify_fused, overrides, 3, timeout=300)
    assert_all_passed(name, [checks for checks, _ in per_rank], 3)
    # step 1 makes AdamW's state through torch's own step (host clip); steps 2 and 3 stay on the device
    assert all(layout_calls == 2 for _, layout_calls in per_rank), [c for _, c in per_rank]


def _skip_everywhere(bad_rank: int) -> tuple[float, float, list[float]]:
    """Two ranks, one FSDP2-sharded linear each step: an inf in one rank's gradient skips the step on both."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from loom.config import TrainConfig
    from loom.train.optim import GradNormShare, ModuleOptimizers, clip_in_optimizer

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.language = torch.nn.Linear(4, 4)
    fully_shard(model.language, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    cfg = TrainConfig()
    opt = ModuleOptimizers(model, ["language"], cfg)
    for group in opt.param_groups:
        group.update(fused=True, foreach=None)
    share = GradNormShare(("language",), frozenset({"language"}), frozenset({"language"} if dist.get_rank() == 0
                                                                              else set()))
    model.language(torch.ones(2, 4)).sum().backward()
    if dist.get_rank() == bad_rank:
        model.language.weight.grad.to_local()[0, 0] = math.inf
    before = model.language.weight.to_local().clone()
    norm, finite = clip_in_optimizer(model, opt, 1.0, share)
    opt.step()
    changed = float((model.language.weight.to_local() - before).abs().max())
    return float(norm), float(finite), [changed]


def test_an_inf_on_one_rank_skips_the_step_on_every_rank(worlds):
    for bad in (0, 1):  # a rank that adds its module's norm, and one that does not: both must be seen
        per_rank = worlds.run(2, _skip_everywhere, bad, timeout=120)
        assert all(finite == 0.0 and changed == [0.0] for _, finite, changed in per_rank), per_rank
    per_rank = worlds.run(2, _skip_everywhere, -1, timeout=120)
    assert all(finite == 1.0 and changed[0] > 0 for _, finite, changed in per_rank), per_rank
    assert per_rank[0][0] == per_rank[1][0]  # one norm, the world's
