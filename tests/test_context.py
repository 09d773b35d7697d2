"""Context parallelism: the zigzag split by hand, and CP attention on 2 and 4 gloo ranks against plain
attention over whole samples (outputs and gradients of q, k, v), GQA and very different sample lengths."""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.data.batch import Batch
from loom.data.spans import TokenSpans
from loom.models.attention import attend
from loom.parallel.context import shard_for_context, zigzag_indices


def test_zigzag_by_hand():
    # one sample of 8 tokens, cp 2: chunks of 2; rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_indices([8], 0, 2) == [0, 1, 6, 7]
    assert zigzag_indices([8], 1, 2) == [2, 3, 4, 5]
    # two samples (4 and 8 tokens), cp 2: the second sample starts at 4
    assert zigzag_indices([4, 8], 0, 2) == [0, 3, 4, 5, 10, 11]
    assert zigzag_indices([4, 8], 1, 2) == [1, 2, 6, 7, 8, 9]
    # every rank's share together covers every token exactly once
    lengths = [8, 16, 24]
    seen = sorted(i for r in range(4) for i in zigzag_indices(lengths, r, 4))
    assert seen == list(range(sum(lengths)))


LENGTHS = [8, 64, 16, 120]  # very different lengths, each a multiple of 2·cp for cp ∈ {2, 4}
HEADS, KV_HEADS, DIM = 4, 2, 8


def _cp_attention_matches_whole_samples() -> dict:
    torch.manual_seed(0)  # same tensors on every rank
    total = sum(LENGTHS)
    q = torch.randn(total, HEADS, DIM, dtype=torch.float64)
    k = torch.randn(total, KV_HEADS, DIM, dtype=torch.float64)
    v = torch.randn(total, KV_HEADS, DIM, dtype=torch.float64)
    upstream = torch.randn(total, HEADS, DIM, dtype=torch.float64)
    full = TokenSpans.from_lengths(LENGTHS)
    # reference: plain causal attention per sample on one rank's full copy
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = attend(qr, kr, vr, full, causal=True)
    (ref * upstream).sum().backward()

    # context parallel: shard token ids that name their global index, so the kept indices can be read back
    ids = torch.arange(total)
    batch = Batch(ids, ids, torch.zeros(total, dtype=torch.long), full, {})
    local, _ = shard_for_context(batch, dist.group.WORLD, [])
    keep = local.input_ids
    ql, kl, vl = (t[keep].clone().requires_grad_(True) for t in (q, k, v))
    out = attend(ql, kl, vl, local.spans, causal=True)
    (out * upstream[keep]).sum().backward()
    # each rank's gradients cover its own tokens; summing the scattered pieces gives the whole gradient
    grads = {}
    for name, t in (("q", ql), ("k", kl), ("v", vl)):
        whole = torch.zeros(total, *t.shape[1:], dtype=t.dtype)
        whole[keep] = t.grad
        dist.all_reduce(whole)
        grads[name] = whole
    return {
        "out": (out - ref.detach()[keep]).abs().max().item(),
        "dq": (grads["q"] - qr.grad).abs().max().item(),
        "dk": (grads["k"] - kr.grad).abs().max().item(),
        "dv": (grads["v"] - vr.grad).abs().max().item(),
        "local_tokens": keep.numel(),
    }


def test_cp_attention_equals_whole_sample_attention_on_2_ranks(worlds):
    for r in worlds.run(2, _cp_attention_matches_whole_samples):
        assert r["local_tokens"] == sum(LENGTHS) // 2
        assert max(r["out"], r["dq"], r["dk"], r["dv"]) < 1e-12, r


def test_cp_attention_equals_whole_sample_attention_on_4_ranks(worlds):
    for r in worlds.run(4, _cp_attention_matches_whole_samples):
        assert r["local_tokens"] == sum(LENGTHS) // 4
        assert max(r["out"], r["dq"], r["dk"], r["dv"]) < 1e-12, r


def _selectors_pick_local_placeholder_rows() -> list[int]:
    pid = 7
    ids = torch.tensor([1, pid, pid, 2, 3, pid, 4, 5] + [pid, 6, 6, pid])  # two samples: 8 and 4 tokens
    batch = Batch(ids, ids, torch.zeros(12, dtype=torch.long), TokenSpans.from_lengths([8, 4]), {})
    local, sel = shard_for_context(batch, dist.group.WORLD, [pid])
    return sel[pid].tolist()


def test_selectors_pick_the_rows_of_local_placeholders(worlds):
    # placeholders (in order, rows 0..4) sit at global tokens 1, 2, 5, 8, 11.
    # cp 2: sample 1 (8 tokens) rank 0 keeps 0,1,6,7 and rank 1 keeps 2..5; sample 2 (4) rank 0 keeps 8,11
    rank0, rank1 = worlds.run(2, _selectors_pick_local_placeholder_rows)
    assert rank0 == [0, 3, 4]
    assert rank1 == [1, 2]
