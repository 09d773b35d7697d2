"""The cost model's activation memory (plan_search/activations.py) against what loom's own layers really save:
autograd's saved tensors counted on CPU (each storage once, weights and the shared rotary table left out), and
the LM head + loss's peak counted by a live-tensor dispatch mode."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import loom.models.encoder_layer as encoder_module
import loom.models.llm as llm_module
from loom.data.spans import TokenSpans
from loom.model_config import LLMConfig
from loom.models.encoder_layer import EncoderLayer
from loom.models.layers import Rotary
from loom.models.llm import DecoderLayer
from loom.plan_search.activations import head_bytes_per_row, saved_bytes_per_token_layer
from loom.plan_search.cost import ModuleSizes
from loom.train.loss import token_loss_sum

DTYPE = torch.bfloat16


class _Flash(torch.autograd.Function):
    """FlashAttention's saved set (q, k, v, out, fp32 log-sum-exp per head): the CUDA kernel's, on a CPU."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.zeros_like(q)
        ctx.save_for_backward(q, k, v, out, torch.zeros(q.shape[1], q.shape[0]))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, *_ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@pytest.fixture
def flash(monkeypatch):
    def attend(q, k, v, spans, causal):
        return _Flash.apply(q, k, v)

    monkeypatch.setattr(llm_module, "attend", attend)
    monkeypatch.setattr(encoder_module, "attend", attend)


def _saved(run, skip: set[int]) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(n for k, n in seen.items() if k not in skip)


def _decoder(tokens: int, qk_norm: bool):
    cfg = LLMConfig(hidden_size=96, num_heads=6, num_kv_heads=2, intermediate_size=160, attention_bias=True,
                    qk_norm=qk_norm)
    layer, rotary = DecoderLayer(cfg).to(DTYPE), Rotary(cfg.rope_dim, cfg.rope_theta)
    x = torch.randn(tokens, 96, dtype=DTYPE, requires_grad=True)
    rope, spans = rotary(torch.arange(tokens), DTYPE, 1), TokenSpans.from_lengths([tokens])
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {t.untyped_storage().data_ptr() for t in rope}
    sizes = ModuleSizes("language", 0, 0, 0, 1, 96, 96, 32, 2, 160, 4, True, norm_fp32=True, qk_norm=qk_norm)
    return sizes, lambda: layer(x, rope, spans), skip


def _encoder(tokens: int, qk_norm: bool):
    layer = EncoderLayer(96, 6, 160, 1e-6, "tanh").to(DTYPE)
    x = torch.randn(tokens, 96, dtype=DTYPE, requires_grad=True)
    spans = TokenSpans.from_lengths([tokens // 4] * 4)
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    sizes = ModuleSizes("vision", 0, 0, 0, 1, 96, 96, 96, 6, 160, 2, False)
    # the block's input is the previous block's output, which LayerNorm keeps: counted, so not skipped
    return sizes, lambda: layer(x, spans), skip - {x.untyped_storage().data_ptr()}


@pytest.mark.parametrize("make,qk_norm", [(_decoder, False), (_decoder, True), (_encoder, False)])
def test_saved_bytes_match_loom_layers(flash, make, qk_norm):
    """Per token (the slope between two token counts): the count is what autograd saves, within 1%."""
    got = []
    for tokens in (64, 256):
        sizes, run, skip = make(tokens, qk_norm)
        got.append(_saved(run, skip))
    measured = (got[1] - got[0]) / (256 - 64)
    counted = saved_bytes_per_token_layer(sizes, 1, 2)
    assert counted == pytest.approx(measured, rel=0.01), (counted, measured)


class _Live(TorchDispatchMode):
    """Peak bytes of the tensors alive (each storage once, freed with it) over what runs under it."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (key := t.untyped_storage().data_ptr()) and key not in self.live:
                self.live[key] = t.untyped_storage().nbytes()
                self.now += self.live[key]
                self.peak = max(self.peak, self.now)
                weakref.finalize(t.untyped_storage(), self._free, key)
        return out

    def _free(self, key):
        self.now -= self.live.pop(key, 0)


def test_head_and_loss_peak_is_counted():
    rows, vocab, hidden = 64, 2048, 32
    head = torch.nn.Linear(hidden, vocab, bias=False).to(DTYPE)
    x = torch.randn(rows, hidden, dtype=DTYPE, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,))
    live = _Live()
    with live:
        logits = head(x)  # held through backward, as the runner holds it
        token_loss_sum(logits, labels).backward()
    weight_grad = 2 * hidden * vocab  # the head's weight gradient (FSDP-managed, not the head's peak)
    measured = (live.peak - weight_grad) / rows
    assert head_bytes_per_row(vocab, 1, 2, compiled_loss=False) == pytest.approx(measured, rel=0.02)
