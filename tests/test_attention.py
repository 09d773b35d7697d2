"""Attention layouts against a naive reference, and the same samples through BSHD and THD in the full model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import Spec, make_sample, sharpen
from loom.data.batch import IGNORE_INDEX, pad_samples
from loom.data.packing import pack_samples
from loom.data.spans import TokenSpans
from loom.models.attention import attend

# ---------------------------------------------------------------- naive reference


def naive_attention(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ/√d + mask) v in float64, one query head at a time; query head h reads kv head
    h // (q heads / kv heads). q: [T, Hq, d], k/v: [T, Hkv, d], allowed: bool [T(query), T(key)]."""
    q, k, v = q.double(), k.double(), v.double()
    t, hq, d = q.shape
    group = hq // k.shape[1]
    bias = torch.zeros(allowed.shape, dtype=torch.float64)
    bias[~allowed] = float("-inf")
    out = torch.empty_like(q)
    for h in range(hq):
        kv = h // group
        scores = q[:, h] @ k[:, kv].T / math.sqrt(d) + bias
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, kv]
    return out


def block_mask(lengths: list[int], causal: bool) -> torch.Tensor:
    """Hand-built block-diagonal mask: token i may see token j iff same sample (and j <= i if causal)."""
    total = sum(lengths)
    seg = []
    for k, n in enumerate(lengths):
        seg += [k] * n
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for i in range(total):
        for j in range(total):
            allowed[i, j] = seg[i] == seg[j] and (j <= i or not causal)
    return allowed


def _qkv(total, hq, hkv, d, g, scale=1.5):
    # scale > 1 gives peaked softmaxes, so a wrong mask moves the output far beyond tolerance
    return (
        torch.randn(total, hq, d, generator=g) * scale,
        torch.randn(total, hkv, d, generator=g) * scale,
        torch.randn(total, hkv, d, generator=g),
    )


LENGTHS = [1, 17, 3, 1, 40, 2]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_packed_matches_naive(causal, heads):
    hq, hkv = heads
    g = torch.Generator().manual_seed(hq * 10 + hkv + causal)
    q, k, v = _qkv(sum(LENGTHS), hq, hkv, 8, g)
    layout = TokenSpans.from_lengths(LENGTHS, backend="sdpa")
    out = attend(q, k, v, layout, causal=causal)
    ref = naive_attention(q, k, v, block_mask(LENGTHS, causal))
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_packed_auto_backend_on_cpu_is_exact(backend):
    g = torch.Generator().manual_seed(3)
    q, k, v = _qkv(sum(LENGTHS), 4, 2, 8, g)
    out = attend(q, k, v, TokenSpans.from_lengths(LENGTHS, backend=backend), causal=True)
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, block_mask(LENGTHS, True)), rtol=1e-5, atol=1e-5)


def test_varlen_backend_on_cpu_fp32_is_an_explicit_error():
    g = torch.Generator().manual_seed(3)
    q, k, v = _qkv(5, 4, 2, 8, g)
    with pytest.raises(RuntimeError, match="varlen"):
        attend(q, k, v, TokenSpans.from_lengths([2, 3], backend="varlen"), causal=True)


def test_values_narrower_than_keys_through_every_packed_path(monkeypatch):
    """Multi-head latent attention's values are narrower than its keys. Per-sample SDPA (CPU) and the varlen path
    give the naive answer; varlen here is a stand-in that, like FlashAttention, takes one head width only, so it
    sees the values padded to the keys' width and the output cut back."""
    import loom.models.attention as attention

    lengths = [5, 3, 6]
    spans = TokenSpans.from_lengths(lengths)
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(sum(lengths), 4, 12, generator=g) for _ in range(2))
    v = torch.randn(sum(lengths), 4, 8, generator=g)
    allowed = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril() for n in lengths])
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(12)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    want = torch.einsum("hqk,khd->qhd", weights, v.double()).float()

    def one_width_varlen(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], "FlashAttention takes one head width"
        return attention._packed_sdpa(q, k, v, TokenSpans.from_cu_seqlens(cu_q), is_causal)

    monkeypatch.setattr(attention, "_VARLEN", one_width_varlen)
    monkeypatch.setattr(attention, "_VARLEN_PARAMS", frozenset({"is_causal"}))
    for got in (attend(q, k, v, spans, causal=True), attention._varlen(q, k, v, spans, spans, causal=True)):
        assert got.shape == (sum(lengths), 4, 8)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_long_samples_apart_equals_the_reference():
    """Long samples in dense calls of their own, the runs of short ones between them in one packed call each, the
    pieces put back in token order: the same outputs and gradients as the naive reference. The kernels are CPU
    stand-ins (per-sample SDPA) that record what each call received, so a misplaced run boundary changes the
    samples a call sees and the answer with them."""
    from loom.models.attention import _packed_sdpa, grouped_sdpa, long_samples_apart

    lengths = [3, 20, 5, 7, 16, 25, 2, 0, 0]  # long from 16: samples 1, 4, 5; empty budget segments at the end
    seen = []

    def run(q, k, v, spans, causal):
        seen.append(("run", [b - a for a, b in zip(spans.bounds[:-1], spans.bounds[1:])]))
        return _packed_sdpa(q, k, v, spans, causal)

    def one(q, k, v, causal):
        seen.append(("one", q.shape[0]))
        out = grouped_sdpa(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), causal=causal)
        return out.squeeze(0).transpose(0, 1)

    g = torch.Generator().manual_seed(5)
    q, k, v = (t.requires_grad_() for t in _qkv(sum(lengths), 4, 2, 8, g))
    spans = TokenSpans.from_lengths(lengths)
    out = long_samples_apart(q, k, v, spans, True, long_from=16, run=run, one=one)
    assert seen == [("run", [3]), ("one", 20), ("run", [5, 7]), ("one", 16), ("one", 25), ("run", [2, 0, 0])]
    ref = naive_attention(q, k, v, block_mask(lengths, True))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(attend(q, k, v, spans, causal=True), (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_long_sample_padded_to_its_shape_is_exact():
    """A long sample's own call pads its tokens to LONG_SAMPLE_MULTIPLE (few shapes, few cuDNN plans); under the
    causal mask no real query reads a padded key, so outputs and gradients equal the unpadded call's."""
    from loom.models.attention import LONG_SAMPLE_MULTIPLE, _dense_first_cudnn, grouped_sdpa

    n = LONG_SAMPLE_MULTIPLE + 300
    g = torch.Generator().manual_seed(7)
    q, k, v = (t.requires_grad_() for t in _qkv(n, 4, 2, 8, g))
    out = _dense_first_cudnn(q, k, v, causal=True)
    ref = grouped_sdpa(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), causal=True).squeeze(0).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn(out.shape, generator=g)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_long_samples_flag():
    from loom.data.spans import LONG_SAMPLE

    assert TokenSpans.from_lengths([LONG_SAMPLE, 3]).long_samples
    assert not TokenSpans.from_lengths([LONG_SAMPLE - 1, 3], segments=8, max_seqlen=4 * LONG_SAMPLE).long_samples
    assert TokenSpans.from_cu_seqlens(torch.tensor([0, 5, 5 + LONG_SAMPLE])).long_samples


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN and FlashAttention run on a GPU")
def test_long_samples_on_the_gpu_match_varlen():
    """`auto` on a GPU: samples of LONG_SAMPLE tokens or more through cuDNN, one call each, the rest through varlen;
    against varlen alone (FlashAttention 2) at bf16's precision, outputs and gradients."""
    from loom.data.spans import LONG_SAMPLE

    lengths = [300, LONG_SAMPLE + 512, 77, 500, LONG_SAMPLE, 41]
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (torch.randn(sum(lengths), h, 128, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for h in (12, 2, 2))
    grad = torch.randn(sum(lengths), 12, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    results = []
    for backend in ("auto", "varlen"):
        spans = TokenSpans.from_lengths(lengths, device="cuda", backend=backend)
        out = attend(q, k, v, spans, causal=True)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=0.02)


def test_packed_mask_matters():
    """Control: the naive reference with one big segment differs, so the comparison above can fail."""
    g = torch.Generator().manual_seed(4)
    q, k, v = _qkv(sum(LENGTHS), 4, 2, 8, g)
    out = attend(q, k, v, TokenSpans.from_lengths(LENGTHS), causal=True).double()
    wrong = naive_attention(q, k, v, block_mask([sum(LENGTHS)], True))
    assert (out - wrong).abs().max() > 1e-2


def test_from_cu_seqlens_and_from_lengths_agree():
    lay = TokenSpans.from_lengths([3, 1, 5])
    assert lay.cu_seqlens.tolist() == [0, 3, 4, 9] and lay.cu_seqlens.dtype == torch.int32 and lay.max_seqlen == 5
    lay2 = TokenSpans.from_cu_seqlens(torch.tensor([0, 3, 4, 9], dtype=torch.int64))
    assert lay2.cu_seqlens.dtype == torch.int32 and lay2.max_seqlen == 5


def test_from_lengths_copies_to_cuda_from_page_locked_memory(monkeypatch):
    """A copy from pageable memory waits for the stream to drain (an encoder call's spans, mid-step): the offsets
    go to CUDA from pinned memory, non-blocking. CPU stand-ins record the calls."""
    calls = []

    def pin(t):
        calls.append("pin")
        return t

    def to(t, device=None, non_blocking=False, **kw):
        calls.append(("to", str(device), non_blocking, "pin" in calls))
        return t

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    TokenSpans.from_lengths([3, 1, 5], device=torch.device("cuda"))
    assert calls == ["pin", ("to", "cuda", True, True)]
    calls.clear()
    TokenSpans.from_lengths([3, 1, 5])  # the host: nothing to pin
    assert calls == [("to", "cpu", True, False)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_padded_matches_naive_per_row(causal, heads):
    hq, hkv = heads
    lengths = [7, 1, 12, 3]
    seq, d = 12, 8
    g = torch.Generator().manual_seed(hq + hkv + 100 * causal)
    q = torch.randn(len(lengths), seq, hq, d, generator=g) * 1.5
    k = torch.randn(len(lengths), seq, hkv, d, generator=g) * 1.5
    v = torch.randn(len(lengths), seq, hkv, d, generator=g)
    pad_mask = torch.zeros(len(lengths), seq, dtype=torch.bool)
    for row, n in enumerate(lengths):
        pad_mask[row, :n] = True
    out = attend(q, k, v, TokenSpans.from_pad_mask(pad_mask), causal=causal)
    assert out.shape == q.shape
    # padded query rows are never read, but they must stay finite: a NaN there poisons the backward pass
    assert torch.isfinite(out).all()
    for row, n in enumerate(lengths):
        ref = naive_attention(q[row, :n], k[row, :n], v[row, :n], block_mask([n], causal))
        torch.testing.assert_close(out[row, :n].double(), ref, rtol=1e-5, atol=1e-5)


def test_padded_without_mask_is_plain_causal():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 6, 4, 8, generator=g) for _ in range(3))
    out = attend(q, k, v, TokenSpans(), causal=True)
    for row in range(2):
        ref = naive_attention(q[row], k[row], v[row], block_mask([6], True))
        torch.testing.assert_close(out[row].double(), ref, rtol=1e-5, atol=1e-5)


def test_packed_gradients_stay_inside_each_sample():
    """Backward respects the boundaries too: the loss on sample 1's outputs has no gradient on sample 0's k/v."""
    lengths = [5, 7]
    g = torch.Generator().manual_seed(11)
    q, k, v = (t.requires_grad_() for t in _qkv(12, 4, 2, 8, g))
    out = attend(q, k, v, TokenSpans.from_lengths(lengths), causal=False)
    out[5:].sum().backward()
    assert k.grad[:5].abs().max() == 0 and v.grad[:5].abs().max() == 0 and q.grad[:5].abs().max() == 0
    assert k.grad[5:].abs().max() > 0


# ---------------------------------------------------------------- the full model: BSHD == THD


def _logits(model, batch):
    with torch.no_grad():
        return model(batch.input_ids, batch.positions, batch.spans, batch.modality_inputs)


def _naive_loss_sum(logits_per_sample: list[torch.Tensor], samples) -> torch.Tensor:
    """Σ over samples and i of -log softmax(logits[i])[tokens[i+1]] where tokens[i+1] is supervised."""
    total = torch.zeros((), dtype=torch.float64)
    for lg, s in zip(logits_per_sample, samples):
        logp = torch.log_softmax(lg.double(), dim=-1)
        for i in range(len(s) - 1):
            if s.supervised[i + 1]:
                total -= logp[i, s.tokens[i + 1]]
    return total


def _check_close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5):
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    assert err <= rel * scale, f"max abs diff {err:.3e} > {rel:.0e} × {scale:.3e}"


@pytest.mark.parametrize("pad_multiple", [1, 8])
def test_bshd_and_thd_give_the_same_logits_and_loss(tiny_model, mixed_samples, tok, pad_multiple):
    """The issue's acceptance test: vision + audio + text samples, images of different sizes, clips of
    different lengths, one sample of length 1; THD (optionally padded per sample) against BSHD."""
    from loom.train.loss import token_loss_sum

    model = sharpen(tiny_model)
    samples = mixed_samples
    thd = pack_samples(samples, tok.pad_id, multiple_of=pad_multiple, backend="sdpa")
    bshd = pad_samples(samples, tok.pad_id, backend="sdpa")
    lt, lb = _logits(model, thd), _logits(model, bshd)
    assert lt.shape == (thd.input_ids.numel(), 264) and lb.shape == (*bshd.input_ids.shape, 264)
    assert lt.dtype == lb.dtype == torch.float32

    cu = thd.spans.cu_seqlens.tolist()
    per_sample_thd, per_sample_bshd = [], []
    for row, s in enumerate(samples):
        n = len(s)
        per_sample_thd.append(lt[cu[row] : cu[row] + n])
        per_sample_bshd.append(lb[row, :n])
        _check_close(per_sample_thd[-1], per_sample_bshd[-1])
    assert max(x.abs().max().item() for x in per_sample_bshd) > 1.0  # logits are not trivially near zero

    loss_thd = token_loss_sum(lt, thd.labels)
    loss_bshd = token_loss_sum(lb, bshd.labels)
    naive = _naive_loss_sum(per_sample_bshd, samples)
    assert thd.num_supervised == bshd.num_supervised == sum(sum(s.supervised[1:]) for s in samples)
    assert abs(loss_thd.item() - loss_bshd.item()) <= 1e-5 * abs(loss_bshd.item())
    assert abs(loss_bshd.item() - naive.item()) <= 1e-5 * abs(naive.item())


def test_thd_without_boundaries_would_differ(tiny_model, mixed_samples, tok):
    """Control for the test above: if the pack were one segment, later samples' logits would change."""
    from dataclasses import replace

    model = sharpen(tiny_model)
    thd = pack_samples(mixed_samples, tok.pad_id, backend="sdpa")
    one_segment = replace(thd, spans=TokenSpans.from_lengths([thd.input_ids.numel()]))
    good, bad = _logits(model, thd), _logits(model, one_segment)
    start = len(mixed_samples[0])
    assert (good[start:] - bad[start:]).abs().max() > 1e-2


def test_bshd_and_thd_gradients_agree(tiny_model, mixed_samples, tok):
    """Same loss in both layouts ⇒ the same gradient on every parameter (padding contributes nothing)."""
    from loom.train.loss import token_loss_sum

    model = sharpen(tiny_model).train()
    grads = []
    for batch in (pack_samples(mixed_samples, tok.pad_id, multiple_of=4), pad_samples(mixed_samples, tok.pad_id)):
        model.zero_grad(set_to_none=True)
        logits = model(batch.input_ids, batch.positions, batch.spans, batch.modality_inputs)
        token_loss_sum(logits, batch.labels).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters()))
    for name in grads[0]:
        a, b = grads[0][name], grads[1][name]
        assert torch.isfinite(b).all(), name
        if name.endswith("k_proj.bias"):  # zero in exact arithmetic (softmax ignores a shift shared by all keys):
            assert max(a.abs().max().item(), b.abs().max().item()) < 1e-5, name  # rounding noise, both layouts
            continue
        scale = max(b.abs().max().item(), 1e-6)
        assert (a - b).abs().max().item() <= 1e-4 * scale, name


def test_each_sample_in_a_pack_equals_the_sample_alone(tiny_model, mixed_samples, tok):
    """Positions restart at 0 and attention stays inside the sample: packing is invisible to each sample."""
    model = sharpen(tiny_model)
    pack = pack_samples(mixed_samples, tok.pad_id, multiple_of=2)
    assert pack.positions.max() < max(len(s) for s in mixed_samples) + 2
    logits = _logits(model, pack)
    cu = pack.spans.cu_seqlens.tolist()
    for k, s in enumerate(mixed_samples):
        alone = _logits(model, pack_samples([s], tok.pad_id))
        _check_close(logits[cu[k] : cu[k] + len(s)], alone)


def test_positions_reach_the_logits(tiny_model, tok):
    """Control: RoPE is relative, so a constant shift changes nothing, but positions that are not
    0, 1, 2, ... inside a sample do change the logits: the comparisons above see positions."""
    from dataclasses import replace

    model = sharpen(tiny_model)
    g = torch.Generator().manual_seed(2)
    s = make_sample(Spec(images=[(8, 8)], prompt_len=4, answer_len=4), model, tok, g)
    batch = pack_samples([s], tok.pad_id)
    base = _logits(model, batch)
    _check_close(_logits(model, replace(batch, positions=batch.positions + 7)), base, rel=1e-4)
    broken = batch.positions.clone()
    broken[len(s) // 2 :] -= len(s) // 2  # restarts in the middle of the sample
    assert (_logits(model, replace(batch, positions=broken)) - base).abs().max() > 1e-2


def test_encoders_keep_items_separate(tiny_model):
    """Vision/audio attention stays inside each item: an image's features do not depend on its neighbours."""
    model = sharpen(tiny_model)
    g = torch.Generator().manual_seed(6)
    imgs = [torch.randn(3, 8, 12, generator=g), torch.randn(3, 16, 4, generator=g), torch.randn(3, 16, 16, generator=g)]
    clips = [torch.randn(16, 9, generator=g), torch.randn(16, 30, generator=g)]
    with torch.no_grad():
        vis = model.encoder("vision")(imgs)
        aud = model.encoder("audio")(clips)
        assert vis.shape[0] == sum(model.encoder("vision").num_tokens(i) for i in imgs) == 6 + 4 + 16
        assert aud.shape[0] == sum(model.encoder("audio").num_tokens(c) for c in clips) == 5 + 15
        a = 0
        for img in imgs:
            n = model.encoder("vision").num_tokens(img)
            _check_close(vis[a : a + n], model.encoder("vision")([img]))
            a += n
        _check_close(aud[5:], model.encoder("audio")([clips[1]]))


def test_merge_rejects_wrong_placeholder_count(tiny_model, tok):
    g = torch.Generator().manual_seed(8)
    s = make_sample(Spec(images=[(8, 8)]), tiny_model, tok, g)
    batch = pack_samples([s], tok.pad_id)
    extra = torch.randn(3, 8, 12)  # 6 more embeddings than placeholders
    with pytest.raises(ValueError, match=r"4 placeholder tokens but the encoder produced 10"):
        tiny_model(batch.input_ids, batch.positions, batch.spans, {"vision": [s.images[0], extra]})


def test_padding_labels_ignored_by_loss():
    from loom.train.loss import token_loss_sum

    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[1, 2, IGNORE_INDEX, 4, IGNORE_INDEX], [IGNORE_INDEX] * 4 + [7]])
    want = sum(
        -F.log_softmax(logits[b, t].double(), -1)[labels[b, t]]
        for b in range(2)
        for t in range(5)
        if labels[b, t] != IGNORE_INDEX
    )
    assert abs(token_loss_sum(logits, labels).item() - want.item()) <= 1e-5 * abs(want.item())
