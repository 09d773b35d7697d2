"""bench/routing.py: the benchmarks' uniform routing spreads a collapsed router's tokens over every expert and keeps
the router's scores as the weights (so it still trains)."""

from __future__ import annotations

import torch

from bench.routing import use_routing
from loom.model_config import RouterSpec
from loom.models.router import Router


def _collapsed_router(spec: RouterSpec) -> Router:
    router = Router(64, spec)
    torch.nn.init.normal_(router.weight, std=0.02)
    return router


def test_uniform_routing_spreads_identical_tokens_over_every_expert(monkeypatch):
    monkeypatch.setattr(Router, "forward", Router.forward)  # restored after the test: the patch is process-wide
    spec = RouterSpec(num_experts=16, top_k=4)
    router = _collapsed_router(spec)
    x = torch.randn(1, 64).expand(4096, 64).clone()  # every token the same: the router alone picks 4 experts for all
    assert router(x).experts.unique().numel() == spec.top_k

    torch.manual_seed(0)
    use_routing("uniform")
    x.requires_grad_(True)
    route = router(x)
    chosen = route.experts.sort(-1).values
    assert (chosen[:, 1:] != chosen[:, :-1]).all(), "a token's k experts are distinct"
    counts = torch.bincount(route.experts.flatten(), minlength=spec.num_experts).float()
    mean = 4096 * spec.top_k / spec.num_experts
    assert counts.min() > 0.85 * mean and counts.max() < 1.15 * mean, counts
    # the weights are the router's renormalised scores of the drawn experts, and its gradient's path
    expected = route.scores.gather(-1, route.experts)
    torch.testing.assert_close(route.weights, expected / expected.sum(-1, keepdim=True))
    (route.weights * torch.randn_like(route.weights)).sum().backward()  # a plain sum of renormalised weights is flat
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_model_routing_leaves_the_router_alone(monkeypatch):
    monkeypatch.setattr(Router, "forward", Router.forward)
    router = _collapsed_router(RouterSpec(num_experts=16, top_k=4))
    x = torch.randn(1, 64).expand(256, 64).clone()
    before = router(x).experts
    use_routing("model")
    assert torch.equal(router(x).experts, before)
