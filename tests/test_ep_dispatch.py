"""Expert parallelism sends each token once per EP rank it goes to, not once per choice (parallel/expert_dispatch.py).

On 2 and 4 gloo ranks an MoE block with 8 experts, 4 per token, has its experts split over ep = world: every token
chooses several experts on one rank. The rows of hidden width that each all-to-all carries are counted and
compared with the distinct (token, EP rank) pairs of the routing, counted here from the router's choices; the
block's output, input gradient, router gradient and expert gradients equal the same block's on one process (an
expert's gradient there summed over the ranks' tokens)."""

from __future__ import annotations

import pytest

from loom.models.experts import grouped_mm

E, K, D, H, TOKENS = 8, 4, 16, 8, 24


def _ep_block_against_one_process(kernel: str, skewed: bool) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from loom.models.moe import MoEBlock
    from loom.models.router import RouterSpec
    from loom.parallel.experts import ExpertParallel

    ep, rank = dist.get_world_size(), dist.get_rank()
    blocks = []
    for _ in range(2):
        torch.manual_seed(0)
        b = MoEBlock(D, RouterSpec(E, K, "sigmoid", choice_bias=True), H, kernel=kernel)
        with torch.no_grad():
            for p in b.parameters():
                p.normal_(0, 0.3)
            if skewed:  # experts 0-3 take every token: the ranks past the first K // (E // ep) receive none
                b.gate.e_score_correction_bias.copy_(torch.tensor([50.0] * K + [0.0] * (E - K)))
        blocks.append(b)
    one, split = blocks
    parallelize_module(split.experts, init_device_mesh("cpu", (ep,)), ExpertParallel())
    torch.manual_seed(1 + rank)
    x, g = torch.randn(TOKENS, D), torch.randn(TOKENS, D)

    # the rows of hidden width each all-to-all sends from this rank, in call order
    sent: list[int] = []
    all_to_all = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        if input.is_floating_point() and input.shape[-1] == D:
            sent.append(input.shape[0])
        return all_to_all(output, input, *args, **kwargs)

    results = []
    for b in (one, split):
        dist.all_to_all_single = counting
        try:
            xi = x.clone().requires_grad_()
            y = b(xi)
            forward = list(sent)
            y.backward(g)
        finally:
            dist.all_to_all_single = all_to_all
        local_ = {n: (p.to_local() if isinstance(p, DTensor) else p) for n, p in b.named_parameters()}
        grads = {n: torch.zeros_like(local_[n]) if p.grad is None else  # no gradient reached it: zeros, to compare
                 p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for n, p in b.named_parameters()}
        results.append((y.detach(), xi.grad, grads, forward))
        sent.clear()
    (y1, gx1, p1, none), (y2, gx2, p2, forward) = results
    local = E // ep
    diffs = {"out": (y1 - y2).abs().max(), "x_grad": (gx1 - gx2).abs().max()}
    for n in p1:
        want = p1[n]
        if n.startswith("experts."):  # every rank's tokens reach an expert: its rank's slice of the summed gradient
            dist.all_reduce(want)
            want = want[rank * local:(rank + 1) * local]
        diffs[n] = (want - p2[n]).abs().max()
    # the routing, counted independently: which EP rank holds each chosen expert
    with torch.no_grad():
        choices = one.gate(x).experts.tolist()
    pairs = {(t, e // local) for t, chosen in enumerate(choices) for e in chosen}
    several = sum(len({e // local for e in chosen}) < K for chosen in choices)
    return {"diffs": {n: float(d) for n, d in diffs.items()}, "forward": forward, "none": none,
            "router_grad": float(p2["gate.weight"].abs().max()),
            "pairs": len(pairs), "several": several, "to": [sum(r == d for _, r in pairs) for d in range(ep)]}


KERNELS = ["loop", pytest.param("grouped", marks=pytest.mark.skipif(grouped_mm is None, reason="no grouped_mm"))]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("world, skewed", [(2, False), (2, True), (4, False)], ids=["ep2", "ep2-skewed", "ep4"])
def test_dispatch_sends_one_row_per_token_and_rank(worlds, world, skewed, kernel):
    per_rank = worlds.run(world, _ep_block_against_one_process, kernel, skewed, timeout=240)
    for rank, r in enumerate(per_rank):
        assert r["none"] == [], r  # one process: no all-to-all at all
        assert r["several"] > 0, "no token chose two experts of one rank: the test would prove nothing"
        # forward: the tokens out, one row per (token, rank); then the sums home, one per row this rank received
        assert r["forward"] == [r["pairs"], sum(other["to"][rank] for other in per_rank)], (rank, r)
        assert r["pairs"] < TOKENS * K
        assert max(r["diffs"].values()) < 1e-5 < r["router_grad"], (rank, r)  # the router learns through them
    if skewed:  # rank 1 holds experts 4-7: no row reaches it, and it still took part in every collective
        assert [r["to"][1] for r in per_rank] == [0] * world
