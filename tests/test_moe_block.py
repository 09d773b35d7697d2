"""The mixture-of-experts block on one process: routing rules, the two expert kernels, load counts, z-loss.

The oracle here is written token by token, from the routing rules' definitions (not from loom's code): each
token's output is the sum over its chosen experts of weight × SwiGLU_e(x)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from loom.data.spans import TokenSpans
from loom.models.experts import grouped_mm
from loom.models.llm import LLMConfig
from loom.models.moe import MoEBlock, aux_loss_scale
from loom.models.router import RouterSpec

D, H, E = 16, 8, 8


def _block(spec: RouterSpec, shared: int = 0, kernel: str = "loop", z: float = 0.0, seed: int = 0) -> MoEBlock:
    torch.manual_seed(seed)
    b = MoEBlock(D, spec, H, shared, kernel, z)
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0, 0.3)
        if b.gate.e_score_correction_bias is not None:
            b.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.2)
    return b


def _oracle(b: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    s, w = b.gate.spec, b.gate.weight
    out = []
    for t in x:
        logits = w @ t
        scores = logits.softmax(-1) if s.score == "softmax" else logits.sigmoid()
        pick = scores.clone()
        if b.gate.e_score_correction_bias is not None:
            pick = pick + b.gate.e_score_correction_bias
        if s.n_group > 1:
            size = E // s.n_group
            group = [sorted(pick[g * size:(g + 1) * size].tolist())[-2:] for g in range(s.n_group)]
            best = sorted(range(s.n_group), key=lambda g: -sum(group[g]))[: s.topk_group]
            pick = torch.tensor([p if e // size in best else 0.0 for e, p in enumerate(pick.tolist())])
        chosen = sorted(range(E), key=lambda e: -pick[e].item())[: s.top_k]
        weights = torch.stack([scores[e] for e in chosen])
        if s.norm_topk_prob:
            weights = weights / weights.sum()
        weights = weights * s.routed_scaling_factor
        y = sum(wt * (F.silu(b.experts.gate_proj[e] @ t) * (b.experts.up_proj[e] @ t)) @ b.experts.down_proj[e].T
                for wt, e in zip(weights, chosen))
        if b.shared_experts is not None:
            y = y + b.shared_experts(t)
        out.append(y)
    return torch.stack(out)


SPECS = {
    "qwen3-softmax-renormalised": (RouterSpec(E, 2), 0),
    "softmax-not-renormalised": (RouterSpec(E, 3, norm_topk_prob=False), 0),
    "deepseek-sigmoid-bias-groups-shared": (RouterSpec(E, 2, "sigmoid", True, n_group=4, topk_group=2,
                                                       routed_scaling_factor=2.5, choice_bias=True), 1),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_block_equals_the_per_token_definition(name):
    spec, shared = SPECS[name]
    b = _block(spec, shared)
    x = torch.randn(24, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = b(x), _oracle(b, x)
    assert want.abs().max() > 0.1
    assert (got - want).abs().max() < 1e-5


def test_choice_bias_moves_the_choice_not_the_weights():
    """A large bias on expert 0 makes every token choose it, with its unbiased score as weight."""
    spec = RouterSpec(E, 2, "sigmoid", norm_topk_prob=False, choice_bias=True)
    b = _block(spec)
    x = torch.randn(10, D)
    with torch.no_grad():
        b.gate.e_score_correction_bias.zero_()
        b.gate.e_score_correction_bias[0] = 100.0
        route = b.gate(x)
    assert (route.experts == 0).any(-1).all()
    assert torch.equal(route.weights, (x @ b.gate.weight.T).sigmoid().gather(-1, route.experts))


def _grads(b: MoEBlock, x: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_()
    y = b(x)
    y.backward(g)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in b.named_parameters()}


@pytest.mark.skipif(grouped_mm is None, reason="this torch has no grouped_mm")
def test_grouped_gemm_equals_the_loop_with_idle_experts():
    """Forward, input and weight gradients; the bias sends every token to experts 0 and 1 (six idle)."""
    spec = RouterSpec(E, 2, "sigmoid", choice_bias=True)
    loop, grouped = _block(spec, kernel="loop"), _block(spec, kernel="grouped")
    x, g = torch.randn(20, D), torch.randn(20, D)
    for b in (loop, grouped):
        with torch.no_grad():
            b.gate.e_score_correction_bias.copy_(torch.tensor([50.0, 50.0] + [0.0] * (E - 2)))
    a, c = _grads(loop, x, g), _grads(grouped, x, g)
    assert grouped.experts.use_grouped(x) and not loop.experts.use_grouped(x)
    assert (a[0] - c[0]).abs().max() < 1e-6 and (a[1] - c[1]).abs().max() < 1e-6
    for n in a[2]:
        assert (a[2][n] - c[2][n]).abs().max() < 1e-6, n
    assert a[2]["experts.gate_proj"][2:].abs().max() == 0  # idle experts: a zero gradient, present
    assert a[2]["experts.gate_proj"][:2].abs().max() > 0


@pytest.mark.parametrize("kernel", ["loop", pytest.param("grouped", marks=pytest.mark.skipif(
    grouped_mm is None, reason="this torch has no grouped_mm"))])
def test_experts_on_unsorted_rows_equal_the_sorted_run(kernel):
    """`compute(x, counts, ..., back=back)` (EP's arrival order: row i belongs at back[i]) gives the sorted run's
    outputs in x's order, and the same gradients; expert 1 idle."""
    from loom.models.experts import Experts
    from loom.models.row_moves import inverse, take_rows

    e = Experts(4, D, 8, kernel)
    with torch.no_grad():
        for p in e.parameters():
            p.normal_(0, 0.3)
    counts, back = torch.tensor([3, 0, 5, 2]), torch.randperm(10)
    x, g = torch.randn(10, D), torch.randn(10, D)
    runs = []
    for unsorted in (False, True):
        e.zero_grad()
        xi = x.clone().requires_grad_()
        w = (e.gate_proj, e.up_proj, e.down_proj)
        y = e.compute(xi, counts, *w, back=back) if unsorted else take_rows(e.compute(take_rows(xi, inverse(back)),
                                                                                      counts, *w), back)
        y.backward(g)
        runs.append([y.detach(), xi.grad, *(p.grad.clone() for p in w)])
    for a, b in zip(*runs):
        assert (a - b).abs().max() < 1e-6


def test_counts_skip_padding_and_recomputation():
    b = _block(RouterSpec(E, 2))
    x = torch.randn(12, D, requires_grad=True)
    counted = torch.tensor([True] * 9 + [False] * 3)
    with set_checkpoint_early_stop(False):  # recompute the whole forward, the counting included
        # recomputed in backward: counted once
        checkpoint(b, x, TokenSpans(counted=counted), use_reentrant=False).sum().backward()
    with torch.no_grad():
        want = torch.bincount(b.gate(x[:9]).experts.flatten(), minlength=E).float()
        b(x, TokenSpans(counted=counted))  # no gradient: a held-out pass, not counted
    assert torch.equal(b.tokens_per_expert, want) and want.sum() == 18


def test_z_loss_adds_its_gradient_only():
    """The block's output is unchanged; the router's gradient gains coef · scale · ∂Σ logsumexp²."""
    coef, scale = 0.01, 1 / 7
    b, plain = _block(RouterSpec(E, 2), z=coef), _block(RouterSpec(E, 2))
    x, g = torch.randn(10, D), torch.randn(10, D)
    counted = torch.tensor([True] * 8 + [False] * 2)
    with aux_loss_scale(b, scale):
        y = b(x, TokenSpans(counted=counted))
        y.backward(g)
    y_plain = plain(x, TokenSpans(counted=counted))
    z = torch.logsumexp(x[:8] @ plain.gate.weight.T, -1).square().sum()
    (y_plain * g).sum().add(coef * scale * z).backward()
    assert torch.equal(y.detach(), y_plain.detach())
    assert (b.gate.weight.grad - plain.gate.weight.grad).abs().max() < 1e-6
    assert (b.gate.weight.grad - torch.autograd.grad((plain(x) * g).sum(), plain.gate.weight)[0]).abs().max() > 1e-4


def test_sparse_layers_follow_the_hf_rules():
    c = LLMConfig(num_layers=6, num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert c.sparse_layers == [1, 5]  # (i + 1) % 2 == 0, minus layer 3
    assert LLMConfig(num_layers=4, num_experts=4, first_k_dense_replace=1).sparse_layers == [1, 2, 3]
    assert LLMConfig(num_layers=4).sparse_layers == []


@pytest.mark.parametrize("overrides, message", [
    (dict(num_experts_per_tok=5), "num_experts_per_tok = 5 must be ≤ num_experts = 4 (valid: 1…4)"),
    (dict(n_group=3), "n_group = 3 must divide num_experts = 4 (valid: [1, 2, 4])"),
    (dict(n_group=2, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok = 3 exceeds the 2 experts"),
    (dict(mlp_only_layers=[4]), "mlp_only_layers = [4]: layers [4] do not exist (valid: 0…3)"),
    (dict(router_bias_update_rate=-1.0), "router_bias_update_rate = -1.0 must be ≥ 0"),
])
def test_bad_expert_keys_are_named(overrides, message):
    from loom.models.checks import check_experts
    from loom.typed_config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        check_experts(LLMConfig(num_layers=4, num_experts=4, **overrides))


def test_compiled_block_gives_the_same_output_gradients_and_counts():
    """torch.compile (dynamo + AOTAutograd) around the block: the z-loss's gradient survives tracing, the
    counting runs eagerly once."""
    eager = _block(RouterSpec(E, 2), z=0.01)
    compiled = _block(RouterSpec(E, 2), z=0.01)
    compiled.forward = torch.compile(compiled.forward, backend="aot_eager")
    x, g = torch.randn(16, D), torch.randn(16, D)
    with aux_loss_scale(nn.ModuleList([eager, compiled]), 0.5):
        a, c = _grads(eager, x, g), _grads(compiled, x, g)
    assert (a[0] - c[0]).abs().max() < 1e-6 and (a[1] - c[1]).abs().max() < 1e-6
    assert all((a[2][n] - c[2][n]).abs().max() < 1e-6 for n in a[2])
    assert torch.equal(eager.tokens_per_expert, compiled.tokens_per_expert)



def test_a_new_step_scale_compiles_nothing_new():
    """The step's aux-loss scale reaches a compiled block as a tensor (`aux_scale`, set from outside): a new
    normaliser each step recompiles nothing, and the z-loss gradient follows the scale as eager's does."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    eager, compiled = _block(RouterSpec(E, 2), z=0.01), _block(RouterSpec(E, 2), z=0.01)
    compiled.forward = torch.compile(compiled.forward, backend="aot_eager")
    x, g = torch.randn(16, D), torch.randn(16, D)
    frames = []
    for scale in (1 / 3, 1 / 5, 1 / 7):
        with aux_loss_scale(nn.ModuleList([eager, compiled]), scale):
            a, c = _grads(eager, x, g), _grads(compiled, x, g)
        assert (a[2]["gate.weight"] - c[2]["gate.weight"]).abs().max() < 1e-6
        frames.append(counters["frames"]["total"])
    assert frames[1] == frames[2] == frames[0], frames
    assert eager.aux_scale is None and compiled.aux_scale is None  # set for the step only

def test_initial_expert_and_router_weights_are_drawn():
    """Every stacked expert weight and the router start at N(0, init_std), seeded by name (zero experts would
    output zeros and get zero gradients: a model that never uses them, which parity alone cannot see)."""
    from loom.models.init import initial_value
    from loom.models.llm import DecoderLM

    with torch.device("meta"):
        lm = DecoderLM(LLMConfig(num_experts=4, moe_intermediate_size=32, init_std=0.02))
    for name in ("layers.1.mlp.experts.gate_proj", "layers.1.mlp.experts.up_proj", "layers.1.mlp.experts.down_proj",
                 "layers.1.mlp.gate.weight"):
        owner, _, attr = name.rpartition(".")
        t = initial_value(f"language.{name}", lm.get_submodule(owner), attr, lm.get_parameter(name).shape, 0,
                          torch.device("cpu"), 0.02)
        assert abs(t.std().item() - 0.02) < 0.002, name



def test_sequence_balance_loss_gradient_is_the_per_sample_definition():
    """Packed samples of 5, 7 (+1 padding) and 4 tokens and a 3-token filler: the router's gradient gains
    coef · scale · ∂Σ_s Σ_e f_se P_se, f from the sample's counted tokens only, P its mean normalised scores."""
    coef, scale = 0.1, 0.25
    spec = RouterSpec(E, 2, "sigmoid")
    b, plain = _block(spec), _block(spec)
    b.seq_aux_loss_coef = coef
    lengths, real = [5, 8, 4, 3], [5, 7, 4, 0]
    counted = torch.cat([torch.arange(n) < r for n, r in zip(lengths, real)])
    spans = TokenSpans.from_lengths(lengths)
    x, g = torch.randn(20, D), torch.randn(20, D)
    with aux_loss_scale(b, 1.0, scale):
        b(x, TokenSpans(cu_seqlens=spans.cu_seqlens, bounds=spans.bounds, counted=counted)).backward(g)
    want = (plain(x) * g).sum()
    start = 0
    for n, r in zip(lengths, real):
        if r:
            route = plain.gate(x[start:start + r])
            f = torch.bincount(route.experts.flatten(), minlength=E).float() * E / (2 * r)
            p = route.scores / route.scores.sum(-1, keepdim=True)
            want = want + coef * scale * (f * p.mean(0)).sum()
        start += n
    want.backward()
    assert (b.gate.weight.grad - plain.gate.weight.grad).abs().max() < 1e-6
    assert (b.gate.weight.grad - torch.autograd.grad((plain(x) * g).sum(), plain.gate.weight)[0]).abs().max() > 1e-4


@pytest.mark.skipif(grouped_mm is None, reason="this torch has no grouped_mm")
def test_compiled_block_is_one_graph_and_counts_once_under_recomputation():
    """The GPU's block (bf16 experts, grouped GEMM) compiles to one graph (`fullgraph`: a break raises): the
    counts have a static shape and the load count runs inside the graph. Compiled inside activation
    checkpointing, as loom applies them, its recomputation does not count again; output, gradients and counts
    equal eager's."""
    from torch._dynamo.backends.registry import lookup_backend

    graphs = []
    aot_eager = lookup_backend("aot_eager")

    def counting(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    blocks = [_block(RouterSpec(E, 2), kernel="grouped", z=0.01) for _ in range(2)]
    for b in blocks:
        b.experts.to(torch.bfloat16)
    compiled = torch.compile(blocks[1].forward, backend=counting, fullgraph=True)
    x, g = torch.randn(16, D, dtype=torch.bfloat16), torch.randn(16, D, dtype=torch.bfloat16)
    counted = torch.tensor([True] * 13 + [False] * 3)
    results = []
    with aux_loss_scale(nn.ModuleList(blocks), 0.5), set_checkpoint_early_stop(False):
        for forward in (blocks[0].forward, compiled):
            xi = x.clone().requires_grad_()
            checkpoint(forward, xi, TokenSpans(counted=counted), use_reentrant=False).backward(g)
            results.append([xi.grad, *(p.grad for p in blocks[len(results)].parameters())])
    assert len(graphs) == 1 and blocks[0].experts.use_grouped(x)
    assert torch.equal(blocks[0].tokens_per_expert, blocks[1].tokens_per_expert)
    assert blocks[0].tokens_per_expert.sum() == 26
    for a, c in zip(*results):
        assert (a.float() - c.float()).abs().max() < 1e-6
