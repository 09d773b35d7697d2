"""GRPO (loom/rl/grpo.py) through the step's objective seam: at ratio 1 without KL it is advantage-weighted
SFT, and `loom verify` passes with it — clipping, the dual clip, the KL term and both normalisations — on
tp (vocab-parallel logprobs), cp, pp, a fan-in and non-colocated encoders, against the one-process
reference with the same per-token fields."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import text_sample
from oracle import assert_all_passed, run_verify

import loom.data.source
from loom.config import GRPOConfig
from loom.data.batch import IGNORE_INDEX
from loom.data.packing import pack_samples
from loom.train.grpo import GRPO
from loom.train.inputs import StepInputs

VOCAB = 320  # the tiny model's (configs/tiny.toml)


def _text_batch(tok, advantages: list[float]):
    g = torch.Generator().manual_seed(0)
    samples = []
    for a in advantages:
        n = int(torch.randint(12, 30, (1,), generator=g))
        s = text_sample(torch.randint(0, 256, (n,), generator=g).tolist(), 5)
        s.token_fields = {"advantage": [a] * n}
        samples.append(s)
    return pack_samples(samples, tok.pad_id)


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_ratio_one_without_kl_is_advantage_weighted_sft(tiny_model, tok):
    """No behaviour logprobs in the data: lp_old is lp (r = 1 exactly), so the gradient is −A·∇lp — the
    gradient of Σ A·CE; the loss is −Σ A over the completion tokens, and no token counts as clipped."""
    batch = _text_batch(tok, [1.5, -0.5, 2.0])
    objective = GRPO(GRPOConfig())
    inputs = StepInputs.of(batch)
    assert objective.normaliser(inputs) == batch.num_supervised

    def logits():
        return tiny_model.language(batch.input_ids, batch.positions, batch.spans, {})

    loss = objective.loss_sum(logits(), batch)
    loss.backward()
    grpo = _grads(tiny_model)
    mask = batch.labels != IGNORE_INDEX
    advantage = batch.fields["advantage"]
    again = logits().float()
    ce = F.cross_entropy(again.reshape(-1, again.shape[-1]), batch.labels.reshape(-1), reduction="none",
                         ignore_index=IGNORE_INDEX)
    (ce * advantage.reshape(-1)).sum().backward()
    sft = _grads(tiny_model)
    assert loss.item() == pytest.approx(-(advantage * mask).sum().item(), rel=1e-6)
    assert set(grpo) == set(sft)
    for name in sft:  # fp32 rounding of two routes to log-softmax: within 1e-5 of the gradient's scale
        scale = sft[name].abs().max().item()
        torch.testing.assert_close(grpo[name], sft[name], rtol=0, atol=1e-5 * scale, msg=name)
    sums = dict(zip((*objective.metric_names, "tokens"), objective.take_metrics().tolist()))
    assert sums["tokens"] == mask.sum().item() and sums["ratio"] == sums["tokens"]
    assert sums["ratio_deviation"] == 0 and sums["clip_fraction"] == 0
    assert objective.take_metrics() is None  # taken: nothing is kept for the next step


def test_sequence_normalisation_weighs_each_sequence_the_same(tok):
    """normalise = "sequence": every completion token of a sequence weighs 1 / its completion tokens, so
    each sequence's weights sum to 1 and the normaliser is the sequence count."""
    batch = _text_batch(tok, [1.0, 1.0, 1.0, 1.0])
    objective = GRPO(GRPOConfig(normalise="sequence"))
    assert objective.normaliser(StepInputs.of(batch)) == 4
    weights = batch.fields["sequence_weight"] * (batch.labels != IGNORE_INDEX)
    cu = batch.spans.cu_seqlens.tolist()
    per_sequence = [weights[a:b].sum().item() for a, b in zip(cu, cu[1:]) if b > a]
    assert per_sequence[:4] == pytest.approx([1.0] * 4)


def _with_rl_fields(to_sample, reference_values: bool = True):
    """`to_sample` whose samples carry GRPO's fields, drawn from the sample's own tokens (the same on every
    rank and for the reference): an advantage per sample, behaviour logprobs near the untrained model's
    (ratios around 1, some clipped) and, with `reference_values`, reference logprobs."""

    def make(example, tok, counters):
        sample = to_sample(example, tok, counters)
        g = torch.Generator().manual_seed(sum(sample.tokens) * 31 + len(sample))
        n = len(sample)
        advantage = float(torch.randn((), generator=g)) * 2
        near = -math.log(VOCAB)
        sample.token_fields = {
            "advantage": [advantage] * n,
            "logprobs": (near + 0.2 * torch.randn(n, generator=g)).tolist(),
            "ref_logprobs": (near + 0.3 * torch.randn(n, generator=g)).tolist(),
        }
        if not reference_values:
            del sample.token_fields["ref_logprobs"]
        return sample

    return make


def _verify_grpo(overrides: list[str], reference_values: bool = True) -> list[dict]:
    plain = loom.data.source.to_sample
    loom.data.source.to_sample = _with_rl_fields(plain, reference_values)
    try:
        return run_verify(["--train.objective=grpo", *overrides], 2)
    finally:
        loom.data.source.to_sample = plain


def placed(encoders: str, llm: str) -> list[str]:
    return [f"--layout.vision.ranks={encoders}", f"--layout.audio.ranks={encoders}", f"--layout.language.ranks={llm}"]


TERMS = ["--train.grpo.kl_beta=0.1", "--train.grpo.dual_clip=3", "--train.grpo.clip_high=0.28"]
SEQUENCE = ["--train.grpo.normalise=sequence"]
BUDGET = ["--train.microbatches=2", "--data.tokens_per_microbatch=512"]
LAYOUTS = {
    "tp2": (2, TERMS + ["--layout.vision.tp=2", "--layout.audio.tp=2", "--layout.language.tp=2"]),
    "cp2-sequence": (2, TERMS + SEQUENCE + ["--layout.language.cp=2", "--data.pad_to_multiple=4"]),
    "pp2-1f1b": (2, TERMS + ["--layout.language.pp=2", *BUDGET]),
    "fan-in-llm-pp2xtp2-sequence": (4, TERMS + SEQUENCE + ["--layout.vision.tp=1", "--layout.language.pp=2",
                                                           "--layout.language.tp=2", *BUDGET]),
    "noncolocated-llm-cp2": (3, TERMS + placed("0-0", "1-2") + ["--layout.language.cp=2", *BUDGET]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_grpo_verifies_under_every_step(worlds, name):
    world, overrides = LAYOUTS[name]
    assert_all_passed(name, worlds.run(world, _verify_grpo, overrides, timeout=300), 2)
