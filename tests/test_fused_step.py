"""fused_step (train/optim.py): torch's fused AdamW step without its per-step Python, bit for bit the same (CPU:
torch's fused AdamW runs there too)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from loom.train.optim import fused_step


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    a = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    b = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    b.load_state_dict(a.state_dict())

    def opt(m):
        decay = [p for p in m.parameters() if p.ndim >= 2]
        rest = [p for p in m.parameters() if p.ndim < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=1e-2, betas=(0.8, 0.95), eps=1e-6, fused=True)
    return a, b, opt(a), opt(b)


def _grads(models, step: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
    for m in models:
        m(x).square().sum().backward()


def _same(a, b, oa, ob) -> None:
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        sp, sq = oa.state[p], ob.state[q]
        assert all(torch.equal(sp[k], sq[k]) for k in ("exp_avg", "exp_avg_sq", "step"))


@pytest.mark.parametrize("scaled", [False, True])
def test_fused_step_matches_adamw_step(scaled):
    a, b, oa, ob = _pair()
    for step in range(5):
        _grads((a, b), step)
        for o in (oa, ob):
            o.param_groups[0]["lr"] = o.param_groups[1]["lr"] = 1e-2 / (step + 1)  # set_lr each step
            if scaled:  # clip_in_optimizer's coefficient and skip flag; step 3 is skipped
                o.grad_scale, o.found_inf = torch.tensor(2.5), torch.tensor(float(step == 3))
        oa.step()
        fused_step(ob)
        oa.zero_grad(), ob.zero_grad()
        _same(a, b, oa, ob)
    assert getattr(ob, "_loom_fused_lists", None) is not None  # the lean path ran
    if scaled:
        assert float(ob.state[next(b.parameters())]["step"]) == 4  # the skipped step is not counted


def test_fused_step_falls_back_and_follows_a_loaded_state():
    a, b, oa, ob = _pair()
    for step in range(2):
        _grads((a, b), step)
        oa.step(), fused_step(ob)
        oa.zero_grad(), ob.zero_grad()
    # a parameter without a gradient: torch skips it; so does fused_step's own path
    _grads((a, b), 7)
    for m in (a, b):
        m[1].weight.grad = None
    oa.step(), fused_step(ob)
    oa.zero_grad(), ob.zero_grad()
    _same(a, b, oa, ob)
    # a checkpoint load replaces the state: the kept lists must not update the old tensors
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))  # a copy, as from a checkpoint (else the states alias)
    b.load_state_dict(a.state_dict())
    for step in range(3, 5):
        _grads((a, b), step)
        oa.step(), fused_step(ob)
        oa.zero_grad(), ob.zero_grad()
    _same(a, b, oa, ob)


def test_first_step_makes_the_state_torch_makes():
    """fused_step's first step makes the state itself (torch's step refuses a group mixing DTensors and plain
    tensors: a replicated module under TP), the same as torch's first step makes; a parameter without a
    gradient gets zero moments and a count of 0, which its first update then starts from as torch's would."""
    a, b, oa, ob = _pair()
    _grads((a, b), 0)
    for m in (a, b):
        m[1].weight.grad = None
    oa.step(), fused_step(ob)
    assert getattr(ob, "_loom_fused_lists", None) is not None  # its own path from the first step
    untouched = b[1].weight
    assert float(ob.state[untouched]["step"]) == 0 and not ob.state[untouched]["exp_avg"].any()
    assert not oa.state[a[1].weight]  # torch made none for it
    oa.zero_grad(), ob.zero_grad()
    for step in range(1, 3):  # its first update from the zero state equals torch's from no state
        _grads((a, b), step)
        oa.step(), fused_step(ob)
        oa.zero_grad(), ob.zero_grad()
    _same(a, b, oa, ob)


def test_fused_step_leaves_other_optimizers_to_torch():
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)  # not fused
    for _ in range(2):
        m(torch.randn(2, 3)).sum().backward()
        fused_step(opt)
        opt.zero_grad()
    assert getattr(opt, "_loom_fused_lists", None) is None and float(opt.state[m.weight]["step"]) == 2
