"""The routing a benchmark's mixture-of-experts LLM runs with.

A random-init router does not route like a trained one: the residual stream's shared direction dominates its
logits past the first layer, so every token picks the same few experts (the `moe128` bench at 8 layers: 38 of
128 experts used, the busiest taking 1/8 of all choices). That flatters the grouped GEMMs (a few large groups)
and makes expert parallelism's ranks idle or overloaded. Trained routers are kept near balance by their
load-balancing losses, so the benchmarks draw each token's k experts uniformly (distinct, from the device's
generator) by default; `--routing model` keeps the router's own choice. The weights stay the router's softmax
or sigmoid scores of the drawn experts, so the router still receives gradients.
"""

from __future__ import annotations

import torch

from loom.models.router import Router, Routing

MODES = ("uniform", "model")


def use_routing(mode: str) -> None:
    """Set for this process: `uniform` draws every token's experts at random, `model` leaves the router as is."""
    if mode not in MODES:
        raise ValueError(f"routing {mode!r} is not one of {MODES}")
    if mode == "uniform" and not getattr(Router.forward, "uniform", False):
        Router.forward = _uniform(Router.forward)


def _uniform(forward):
    def drawn(self: Router, x: torch.Tensor) -> Routing:
        route = forward(self, x)
        s = self.spec
        experts = torch.rand_like(route.scores).topk(s.top_k, dim=-1).indices  # k distinct, uniform
        weights = route.scores.gather(-1, experts)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return Routing(experts, weights * s.routed_scaling_factor, route.scores, route.logits)

    drawn.uniform = True
    return drawn
