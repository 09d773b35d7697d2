"""The LLM's head on the target rows alone (data/batch.py `target_rows`, `Batch.at_targets`): an SFT step's
prompts, images and clips have no label to read, so their logits are never computed. The loss and every
gradient equal the head over all rows; the objective's per-token fields stay aligned with their labels. Under
sequence parallel the head runs on all rows (train/runners.py `RunContext`), so `loom verify`'s tp·SP cases
(tests/test_parity.py) compare the two paths across a layout as well."""

from __future__ import annotations

import random

import torch

from loom.data.batch import IGNORE_INDEX, TARGET_MULTIPLE, pad_samples, target_rows
from loom.data.packing import pack_samples
from loom.data.sample import Sample
from loom.models.llm import DecoderLM, LLMConfig
from loom.train.loss import token_loss_sum


def _samples(n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt, answer = rng.randint(3, 40), rng.randint(1, 12)
        tokens = [rng.randrange(300) for _ in range(prompt + answer)]
        supervised = [False] * prompt + [True] * answer
        out.append(Sample(tokens, supervised, [], [], token_fields={"value": [float(t) for t in tokens]}))
    return out


def test_target_rows_are_every_target_then_an_ignored_row():
    labels = torch.full((300,), IGNORE_INDEX)
    where = torch.tensor(sorted(random.Random(1).sample(range(300), 70)))
    labels[where] = 7
    rows = target_rows(labels)
    assert rows.numel() == 2 * TARGET_MULTIPLE  # 70 targets rounded up to whole multiples
    assert torch.equal(rows[:70], where)
    assert (labels[rows[70:]] == IGNORE_INDEX).all()
    assert target_rows(torch.full((5,), IGNORE_INDEX)).numel() == TARGET_MULTIPLE  # never empty: a shape to run
    assert target_rows(torch.zeros(0, dtype=torch.long)).numel() == 0  # a replica without samples


def test_a_targets_view_keeps_each_field_beside_its_label():
    """The field holds each token's id and label i is token i + 1: at the targets, field[i + 1] is the label."""
    for batch in (pack_samples(_samples(9), 0, pack_len=512), pad_samples(_samples(5), 0, length=64, rows=6)):
        view = batch.at_targets()
        shifted = batch.fields["value"].reshape(-1).roll(-1).index_select(0, batch.targets)
        real = view.labels != IGNORE_INDEX
        assert real.sum() == batch.num_supervised
        assert torch.equal(view.labels[real].float(), shifted[real])
        assert torch.equal(view.fields["value"], batch.fields["value"].reshape(-1).index_select(0, batch.targets))
        assert view.sequences == batch.sequences


def test_the_head_on_targets_equals_the_head_on_every_row():
    torch.manual_seed(0)
    model = DecoderLM(LLMConfig(vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                intermediate_size=128))
    for batch in (pack_samples(_samples(9), 0, pack_len=512), pad_samples(_samples(5), 0, length=64, rows=6)):
        grads, losses = [], []
        for rows in (None, batch.targets):
            model.zero_grad()
            logits = model(batch.input_ids, batch.positions, batch.spans, logits_at=rows)
            loss = token_loss_sum(logits, batch.labels if rows is None else batch.at_targets().labels)
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in model.parameters()])
        assert batch.targets.numel() < batch.labels.numel() / 2  # the prompts' rows are left out
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
        for a, b in zip(*grads):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)  # fp32 rounding of matmuls of other sizes
