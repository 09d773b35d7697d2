"""The step's fused paths against the plain ones they replace (issue 33, round 5), on CPU: the q/k/v projections as
one matmul over concatenated weights, grouped K/V heads read in place by SDPA, and equal-length packed samples
attended as one batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from loom.data.spans import TokenSpans
from loom.models.attention import _packed_sdpa, attend, grouped_sdpa
from loom.models.layers import project


def _linears(g: torch.Generator, sizes: list[int], biases: list[bool]) -> tuple[nn.Linear, ...]:
    mods = tuple(nn.Linear(24, n, bias=b) for n, b in zip(sizes, biases))
    with torch.no_grad():
        for m in mods:
            m.weight.copy_(torch.randn(m.weight.shape, generator=g))
            if m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    return mods


@pytest.mark.parametrize("biases", [(False, False, False), (True, False, True)])  # Whisper: no key bias
def test_fused_projections_equal_the_separate_linears(biases):
    g = torch.Generator().manual_seed(0)
    linears = _linears(g, [32, 16, 16], list(biases))
    x = torch.randn(7, 24, generator=g, requires_grad=True)
    grads = [torch.randn(7, n, generator=g) for n in (32, 16, 16)]

    def run(fn):
        x.grad = None
        for m in linears:
            m.zero_grad(set_to_none=True)
        outs = fn()
        torch.autograd.backward(list(outs), grads)
        return [o.detach() for o in outs] + [x.grad] + [p.grad for m in linears for p in m.parameters()]

    fused, separate = run(lambda: project(x, linears)), run(lambda: [m(x) for m in linears])
    for a, b in zip(fused, separate, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_hooked_linear_is_called_not_fused():
    # tensor parallel's plans place a linear's input and output through its hooks: those must run
    g = torch.Generator().manual_seed(0)
    linears = _linears(g, [8, 8], [True, True])
    calls = []
    linears[1].register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    project(torch.randn(3, 24, generator=g), linears)
    assert calls == [torch.Size([3, 8])]


def _qkv(g: torch.Generator, total: int, hq: int = 4, hkv: int = 2, d: int = 8):
    return tuple((torch.randn(total, h, d, generator=g) * 1.5).requires_grad_() for h in (hq, hkv, hkv))


@pytest.mark.parametrize("causal", [True, False])
def test_equal_length_samples_attend_as_the_per_sample_loop(causal):
    g = torch.Generator().manual_seed(0)
    lengths = [6, 6, 6, 0, 0]  # trailing empty segments, as a compiled microbatch's fixed segment count has
    spans = TokenSpans.from_lengths(lengths)
    assert spans.equal_length == 6
    q, k, v = _qkv(g, 18)
    out = attend(q, k, v, spans, causal=causal)
    grad = torch.randn(out.shape, generator=g)
    got = [out] + list(torch.autograd.grad(out, (q, k, v), grad))
    ref_out = _packed_sdpa(q, k, v, spans, causal)
    ref = [ref_out] + list(torch.autograd.grad(ref_out, (q, k, v), grad))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_only_equal_lengths_are_marked():
    assert TokenSpans.from_lengths([4, 3]).equal_length == 0
    assert TokenSpans.from_lengths([5, 5], segments=4).equal_length == 5
    assert TokenSpans.from_lengths([]).equal_length == 0


def test_grouped_heads_in_place_equal_expanded_heads():
    g = torch.Generator().manual_seed(0)
    q, k, v = (t.detach().transpose(0, 1).unsqueeze(0) for t in _qkv(g, 10))  # [1, h, s, d]
    expanded = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(grouped_sdpa(q, k, v, causal=True), expanded, rtol=1e-5, atol=1e-5)
