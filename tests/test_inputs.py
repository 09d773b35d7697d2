"""A step's microbatches from host data: every sample once per module, fixed token counts, encoder parts
that the bridge can concatenate (fan-in) or narrow (fan-out), and the reference's token count."""

from __future__ import annotations

import pytest
import numpy as np
import torch
from conftest import MIXED_SPECS, TINY_MODEL_OVERRIDES, make_sample

from loom.job import load_config
from loom.data.batch import IGNORE_INDEX, supervised_count
from loom.train.inputs import Share, collate, plan_inputs
from loom.train.step_parts import Parts, split_encoder_parts


def _cfg(*extra: str):
    return load_config(None, [*TINY_MODEL_OVERRIDES, "--data.train_size=64", *extra])


@pytest.fixture
def batch16(tiny_model, tok):
    g = torch.Generator().manual_seed(3)
    return [make_sample(MIXED_SPECS[i % len(MIXED_SPECS)], tiny_model, tok, g) for i in range(16)]


def _plans(samples, cfg, tok, model, shares_of):
    counters = {n: model.encoder(n).num_tokens for n in model.encoder_names}
    ids = list(range(100, 100 + len(samples)))
    return [plan_inputs(samples, ids, cfg, tok, counters, shares, 1, torch.device("cpu")) for shares in shares_of]


def _key(tokens: torch.Tensor) -> tuple[int, ...]:
    return tuple(tokens.tolist())


@pytest.mark.parametrize("m,budget", [(1, 0), (2, 0), (2, 256), (4, 256)])
def test_every_sample_once_and_the_global_token_count(batch16, tiny_model, tok, m, budget):
    cfg = _cfg(f"--train.microbatches={m}", f"--data.tokens_per_microbatch={budget}", "--train.global_batch_size=16")
    dp = 2
    plans = _plans(batch16, cfg, tok, tiny_model, [{"language": (r, dp), "vision": (r, dp), "audio": (r, dp)}
                                                    for r in range(dp)])
    reference = collate(batch16, cfg, tok)
    for p in plans:
        assert p.supervised == reference.num_supervised  # every rank knows the global count, no collective
        assert len(p.microbatches) == m
        if budget:
            assert all(mb.llm.input_ids.numel() == budget for mb in p.microbatches)  # fixed shapes
    supervised = sum(int((mb.llm.labels != IGNORE_INDEX).sum()) for p in plans for mb in p.microbatches)
    assert supervised == reference.num_supervised
    real = sum(p.tokens for p in plans)
    assert real == sum(len(s) for s in batch16)
    images = sorted(_key(x.flatten()[:8]) for p in plans for mb in p.microbatches for x in mb.encoder_items["vision"])
    assert images == sorted(_key(x.flatten()[:8]) for s in batch16 for x in s.images)


def test_fan_in_parts_are_contiguous_and_row_balanced():
    rows = np.array([5, 1, 1, 1, 1, 1, 0, 6])

    def split_encoder(llm, rows, dp):
        return split_encoder_parts(Parts.of(llm), rows, dp).lists()

    assert split_encoder([[0, 1, 2, 3, 4, 5, 6, 7]], rows, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 8 | 8 rows
    assert split_encoder([[0, 1]], rows, 4) == [[], [0], [], [1]]  # runs may be empty, order kept
    llm = [[0, 1, 2, 3], [4, 5, 6, 7]]
    parts = split_encoder(llm, rows, 4)  # fan-in: each LLM replica's samples split over 2 encoder replicas
    assert [p for part in parts for p in part] == [0, 1, 2, 3, 4, 5, 6, 7] and len(parts) == 4
    assert split_encoder(llm, rows, 1) == [[0, 1, 2, 3, 4, 5, 6, 7]]  # fan-out: one replica serves both
    assert split_encoder(llm, rows, 2) == llm


def test_bridge_row_counts_agree_on_both_sides(batch16, tiny_model, tok):
    cfg = _cfg("--train.microbatches=2", "--data.tokens_per_microbatch=256", "--train.global_batch_size=16")
    shares = [{"language": (r, 2), "vision": (e, 4), "audio": (r // 2, 1)}
              for r in range(2) for e in (2 * r, 2 * r + 1)]
    plans = _plans(batch16, cfg, tok, tiny_model, shares)
    for k in range(2):
        for name, dp in (("vision", 4), ("audio", 1)):
            counts = plans[0].microbatches[k].rows[name]
            assert all(p.microbatches[k].rows[name] == counts for p in plans)  # every rank, the same plan
            assert len(counts.encoder) == dp and len(counts.llm) == 2 and sum(counts.encoder) == sum(counts.llm)
            for p, share in zip(plans, shares):
                held = sum(tiny_model.encoder(name).num_tokens(x) for x in p.microbatches[k].encoder_items[name])
                assert held == counts.encoder[share[name][0]]


def test_a_later_encoder_stage_decodes_no_media(batch16, tiny_model, tok):
    """A pipelined encoder's later stage takes hidden states from the stage before: its rank gets the same rows
    per item (the stage link's shapes) and counts, and no decoded images or clips."""
    cfg = _cfg("--train.microbatches=2", "--train.global_batch_size=16")
    first, later = _plans(batch16, cfg, tok, tiny_model,
                          [{"language": (0, 1), name: Share(0, 1, reads), "audio": (0, 1)} for name, reads in
                           (("vision", True), ("vision", False))])
    for a, b in zip(first.microbatches, later.microbatches):
        assert a.encoder_items["vision"] and b.encoder_items["vision"] == []
        assert a.item_rows == b.item_rows and a.rows == b.rows
        assert len(a.encoder_items["audio"]) == len(b.encoder_items["audio"])  # the other encoder reads its own


def test_a_sample_longer_than_the_budget_names_its_index(batch16, tiny_model, tok):
    cfg = _cfg("--data.tokens_per_microbatch=16", "--train.global_batch_size=16")
    with pytest.raises(ValueError, match=r"sample 10\d of the dataset.*data.tokens_per_microbatch"):
        _plans(batch16, cfg, tok, tiny_model, [{"language": (0, 1), "vision": (0, 1), "audio": (0, 1)}])


def test_too_long_samples_are_skipped_when_asked(batch16, tok):
    from loom.train.length_rules import fitting

    cfg = _cfg("--data.tokens_per_microbatch=16", "--data.too_long=skip")
    kept, indices, skipped = fitting(batch16, list(range(16)), cfg, multiple=4)
    assert [len(s) for s in kept] == [len(s) for s in batch16 if -(-len(s) // 4) * 4 <= 16]
    assert skipped == 16 - len(kept) > 0 and indices == [i for i, s in enumerate(batch16) if s in kept]
    first = next(i for i, s in enumerate(batch16) if -(-len(s) // 4) * 4 > 16)
    with pytest.raises(ValueError,
                       match=rf"sample {first} of the dataset: \d+ tokens .* data.tokens_per_microbatch = 16"):
        fitting(batch16, list(range(16)), _cfg("--data.tokens_per_microbatch=16"), 4)  # "error": the first named


def test_the_longest_builtin_sample_bounds_every_drawn_one(tok):
    from loom.train.build import build_job_model, token_counters
    from loom.train.job_data import build_job_data

    cfg = _cfg("--data.train_size=600")
    data = build_job_data(cfg, tok, token_counters(build_job_model(cfg, tok)))
    longest, train = data.longest, data.train
    drawn = {}
    for i in range(len(train)):
        s = train[i]
        drawn[s.task] = max(drawn.get(s.task, 0), len(s))
    for task, n in drawn.items():
        assert n <= longest[f"task {task!r}"], task
        assert n >= 0.9 * longest[f"task {task!r}"], task  # a bound, but not a loose one


def test_a_budget_below_the_longest_sample_fails_before_training(tmp_path):
    from conftest import tiny_job_overrides

    import loom.cli

    args = ["train", "configs/tiny.toml", *tiny_job_overrides(tmp_path), "--data.tokens_per_microbatch=32"]
    with pytest.raises(Exception, match=r"task 'shapes' samples reach \d+ tokens.*data.too_long"):
        from loom.job import load_config
        from loom.train.trainer import Trainer

        Trainer(load_config(args[1], args[2:]))
    assert loom.cli.main(args) == 2  # the CLI says so as a config error, before any step


# ---------------------------------------------------------------- padded (bshd) microbatches of fixed [R, S]


def _padded_job(*extra: str):
    """The tiny job's built-in tasks, bshd: config with S resolved (sample multiple 4), counters, batches."""
    from loom.data.tokenizer import ByteTokenizer
    from loom.train.build import build_batches, build_job_model, token_counters
    from loom.train.length_rules import with_padded_length
    from loom.train.job_data import build_job_data

    cfg = _cfg("--data.format=bshd", "--train.global_batch_size=8", "--train.microbatches=2", *extra)
    tok = ByteTokenizer()
    counters = token_counters(build_job_model(cfg, tok))
    data = build_job_data(cfg, tok, counters)
    cfg = with_padded_length(cfg, data.longest, 4)
    return cfg, tok, counters, data.longest, build_batches(cfg, data)


def _padded_steps(cfg, tok, counters, batches, steps=4, dp=2):
    """Every step's microbatches on each of dp LLM replicas (encoders on the same replicas)."""
    from loom.train.length_rules import fitting

    out = []
    for step in range(steps):
        samples, indices, skipped = fitting(batches.shard(step), batches.indices(step), cfg, 4)
        plans = [plan_inputs(samples, indices, cfg, tok, counters, {n: (r, dp) for n in ("language", *counters)}, 4,
                             torch.device("cpu")) for r in range(dp)]
        out.append((samples, skipped, plans))
    return out


def test_padded_microbatches_are_rows_by_the_longest_sample_every_step():
    cfg, tok, counters, longest, batches = _padded_job()
    s = -(-max(longest.values()) // 4) * 4
    assert cfg.data.padded_length == s  # 0 → the longest built-in sample, rounded up to the sample multiple
    lengths = set()
    for samples, _, plans in _padded_steps(cfg, tok, counters, batches):
        for p in plans:
            assert [tuple(mb.llm.input_ids.shape) for mb in p.microbatches] == [(2, s)] * 2  # R = 8 / (dp 2 · M 2)
            lengths.add(tuple(int(n) for mb in p.microbatches for n in mb.llm.spans.pad_mask.sum(1)))
        held = sorted(int(n) for p in plans for mb in p.microbatches for n in mb.llm.spans.pad_mask.sum(1))
        assert held == sorted(len(x) for x in samples)  # every sample once, whole, and no filler row
    assert len(lengths) > 1  # the samples differ from step to step; the shapes do not


def test_padded_length_set_by_hand_and_its_errors():
    from loom.config import ConfigError
    from loom.train.length_rules import check_longest, with_padded_length

    cfg, _, _, longest, _ = _padded_job("--data.padded_length=64")
    assert cfg.data.padded_length == 64
    with pytest.raises(ConfigError, match=r"data.padded_length = 62 is not a multiple of 4.*use 60 or 64"):
        with_padded_length(_cfg("--data.format=bshd", "--data.padded_length=62"), longest, 4)
    short = _cfg("--data.format=bshd", "--data.padded_length=40")
    with pytest.raises(ConfigError, match=r"data.padded_length = 40, but task 'shapes' samples reach 58 tokens.*"
                                          r"raise data.padded_length to at least 60.*data.too_long"):
        check_longest(short, longest, 4)
    check_longest(_cfg("--data.format=bshd", "--data.padded_length=40", "--data.too_long=skip"), longest, 4)
    with pytest.raises(ValueError, match=r"tokens_per_microbatch.*data.padded_length"):  # T is for packed batches
        _cfg("--data.format=bshd", "--data.tokens_per_microbatch=64")
    with pytest.raises(ValueError, match=r"data.padded_length = 64.*data.format = 'bshd'"):  # and S for padded ones
        _cfg("--data.padded_length=64")


def test_skipping_too_long_samples_keeps_every_microbatch_r_rows():
    cfg, tok, counters, _, batches = _padded_job("--data.padded_length=40", "--data.too_long=skip")
    skipped_any = False
    for samples, skipped, plans in _padded_steps(cfg, tok, counters, batches, steps=6):
        skipped_any |= skipped > 0
        assert all(len(x) <= 40 for x in samples) and len(samples) == 8 - skipped
        real = 0
        for p in plans:
            assert p.supervised == sum(supervised_count(x) for x in samples)  # the kept samples' global count
            for mb in p.microbatches:
                b = mb.llm
                assert tuple(b.input_ids.shape) == (2, 40)
                filler = b.spans.pad_mask.sum(1) == 1  # a filler row: one real token, no label
                assert ((b.labels != IGNORE_INDEX).sum(1)[filler] == 0).all()
                real += int((~filler).sum())
        assert real == len(samples)
    assert skipped_any, "no step skipped a sample: the test would prove nothing"


def test_filler_rows_change_nothing_and_give_no_nan(tiny_model, tok, mixed_samples):
    """A padded batch with filler rows (all padding but a first real token) gives the same loss and gradients
    as the samples alone. The real token is there because an all-masked query row is a softmax over nothing:
    NaN in SDPA kernels without a safe softmax (the CPU math kernel has one, so only the mask shows it)."""
    from loom.data.batch import pad_samples
    from loom.train.loss import token_loss_sum

    def loss_and_grads(batch):
        tiny_model.zero_grad()
        logits = tiny_model(batch.input_ids, batch.positions, batch.spans, batch.modality_inputs)
        loss = token_loss_sum(logits, batch.labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in tiny_model.named_parameters() if p.grad is not None}

    alone = pad_samples(mixed_samples, tok.pad_id)
    filled = pad_samples(mixed_samples, tok.pad_id, length=alone.input_ids.shape[1] + 8, rows=len(mixed_samples) + 2)
    assert filled.spans.pad_mask[-2:].sum() == 2 and (filled.labels[-2:] == IGNORE_INDEX).all()
    (a, ga), (b, gb) = loss_and_grads(alone), loss_and_grads(filled)
    assert torch.isfinite(b) and all(torch.isfinite(g).all() for g in gb.values())
    torch.testing.assert_close(b, a)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-5, atol=1e-6, msg=n)
