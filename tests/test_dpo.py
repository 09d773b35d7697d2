"""DPO (loom/rl/dpo.py, `train.objective = "dpo"`): the loss is the formula over each pair's summed logprobs; a
pair's two sequences never part (replica, microbatch, step, a skip); `loom verify` passes on tp, cp, pp, pp·tp
with a fan-in, and non-colocated encoders against the initial policy as reference; CP's sums over a sequence
do not multiply the gradient by cp; a user's JSONL pairs train, and bad pairs are named before any weight is
read."""

from __future__ import annotations

import json

import pytest
import numpy as np
import torch
import torch.nn.functional as F
from conftest import text_sample, tiny_job_overrides, user_data_overrides, write_user_data
from oracle import assert_all_passed, run_verify

from loom.config import DPOConfig
from loom.data.batch import IGNORE_INDEX
from loom.data.conversations import BadSample
from loom.data.packing import pack_samples
from loom.job import load_config
from loom.train.dpo import DPO
from loom.train.inputs import StepInputs
from loom.train.length_rules import fitting
from loom.train.step_parts import split_llm_parts


def _pairs_batch(tok, n_pairs: int):
    """Packed pairs (chosen, rejected) of random text with random reference logprobs on the answers."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(2 * n_pairs):
        n = int(torch.randint(12, 30, (1,), generator=g))
        s = text_sample(torch.randint(0, 256, (n,), generator=g).tolist(), 5)
        s.token_fields = {"ref_logprobs": (-6 + torch.randn(n, generator=g)).tolist()}
        samples.append(s)
    return pack_samples(samples, tok.pad_id)


@pytest.mark.parametrize("cfg", [DPOConfig(beta=0.5), DPOConfig(beta=0.2, length_normalise=True, sft_weight=0.3)],
                         ids=["sums", "length-normalised-with-sft"])
def test_the_loss_is_the_formula_over_each_pairs_sums(tiny_model, tok, cfg):
    batch = _pairs_batch(tok, 3)
    objective = DPO(cfg)
    assert objective.normaliser(StepInputs.of(batch)) == 3
    logits = tiny_model.language(batch.input_ids, batch.positions, batch.spans, {}).float()
    loss = objective.loss_sum(logits, batch)
    # by hand: log-softmax per token, summed per sequence between cu_seqlens
    lp = F.log_softmax(logits, -1).gather(-1, batch.labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    mask = batch.labels != IGNORE_INDEX
    cu = batch.spans.cu_seqlens.tolist()
    expected = 0.0
    for j in range(3):
        sums, tokens, logprob = [], [], []
        for k in (2 * j, 2 * j + 1):
            a, b = cu[k], cu[k + 1]
            m = mask[a:b]
            gain = (lp[a:b][m] - batch.fields["ref_logprobs"][a:b][m]).sum()
            sums.append(gain / m.sum() if cfg.length_normalise else gain)
            tokens.append(m.sum())
            logprob.append(lp[a:b][m].sum())
        expected = expected - F.logsigmoid(cfg.beta * (sums[0] - sums[1]))
        expected = expected - cfg.sft_weight * logprob[0] / tokens[0]
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    margin, accuracy, chosen, rejected, pairs = objective.take_metrics().tolist()
    assert pairs == 3 and 0 <= accuracy <= 3 and margin == pytest.approx(chosen - rejected, abs=1e-5)


def test_a_pair_shares_its_replica_microbatch_and_fate():
    """Pairs carry their item's index side by side: every split keeps them together, in bins and in equal
    shares, and a pair too long for T together is dropped whole under too_long = "skip"."""
    indices = [7, 7, 3, 3, 9, 9, 4, 4, 1, 1, 5, 5]
    tokens = [40, 8, 24, 24, 8, 40, 16, 16, 32, 8, 8, 8]
    rows = {"vision": [1] * 12}
    for overrides in (["--data.tokens_per_microbatch=96", "--train.microbatches=2"], ["--train.microbatches=3"]):
        cfg = load_config("configs/tiny.toml", ["--train.objective=dpo", "--train.reference=initial",
                                                "--train.global_batch_size=12", *overrides])
        parts = [p.lists() for p in split_llm_parts(np.array(tokens), {n: np.array(r) for n, r in rows.items()}, 2,
                                                    cfg.train.microbatches, cfg.data.tokens_per_microbatch,
                                                    np.array(indices))]
        placed = sorted(p for micro in parts for replica in micro for p in replica)
        assert placed == list(range(12))
        for micro in parts:
            for replica in micro:
                assert all(p % 2 == 0 and p + 1 in replica for p in replica if p % 2 == 0)
                assert len(replica) % 2 == 0
    cfg = load_config("configs/tiny.toml", ["--train.objective=dpo", "--train.reference=initial",
                                            "--data.tokens_per_microbatch=64", "--data.too_long=skip"])
    samples = [text_sample([1] * n, 2) for n in (30, 30, 20, 50, 10, 10)]
    kept, kept_indices, dropped = fitting(samples, [0, 0, 1, 1, 2, 2], cfg, 1)
    assert kept_indices == [0, 0, 2, 2] and dropped == 2  # 20 + 50 > 64: both sides of pair 1 left out


def placed(encoders: str, llm: str) -> list[str]:
    return [f"--layout.vision.ranks={encoders}", f"--layout.audio.ranks={encoders}", f"--layout.language.ranks={llm}"]


DPO_RUN = ["--train.objective=dpo", "--train.reference=initial", "--train.global_batch_size=8"]
BUDGET = ["--train.microbatches=2", "--data.tokens_per_microbatch=512"]
LAYOUTS = {
    "tp2": (2, ["--layout.vision.tp=2", "--layout.audio.tp=2", "--layout.language.tp=2"]),
    "cp2-length-normalised-sft": (2, ["--layout.language.cp=2", "--data.pad_to_multiple=4",
                                      "--train.dpo.length_normalise=true", "--train.dpo.sft_weight=0.5"]),
    "pp2-1f1b": (2, ["--layout.language.pp=2", *BUDGET]),
    "fan-in-llm-pp2xtp2": (4, ["--layout.vision.tp=1", "--layout.language.pp=2", "--layout.language.tp=2", *BUDGET]),
    "noncolocated-llm-cp2": (3, placed("0-0", "1-2") + ["--layout.language.cp=2", *BUDGET]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dpo_verifies_under_every_step(worlds, name):
    world, overrides = LAYOUTS[name]
    assert_all_passed(name, worlds.run(world, run_verify, DPO_RUN + overrides, 2, timeout=300), 2)


def _verify_with_reducing_backward(overrides: list[str]) -> list[dict]:
    """A fault: the cp sum's backward all-reduces, as a plain differentiable all-reduce does."""
    import torch.distributed.nn.functional as dist_fn

    import loom.train.dpo as dpo

    plain = dpo.sum_over_shards
    dpo.sum_over_shards = lambda x, group: x if group is None else dist_fn.all_reduce(x, group=group)
    try:
        return run_verify(overrides, 1)
    finally:
        dpo.sum_over_shards = plain


def test_a_reducing_backward_under_cp_fails_verify(worlds):
    per_rank = worlds.run(2, _verify_with_reducing_backward, DPO_RUN + ["--layout.language.cp=2",
                                                                         "--data.pad_to_multiple=4"], timeout=300)
    step = per_rank[0][0]
    assert not step["passed"], "the doubled gradient went unnoticed"
    assert any("grad norm" in f for f in step["failures"]), step["failures"]


def _pair_lines(jsonl, edit=lambda i, line: None) -> None:
    """The user's lines as DPO pairs: the prompt, its answer chosen, a wrong one rejected."""
    lines = []
    for i, raw in enumerate(jsonl.read_text().splitlines()):
        messages = json.loads(raw)["messages"]
        answer = messages[1]["content"]
        line = {"messages": messages[:1], "chosen": answer, "rejected": f"not {answer}"}
        edit(i, line)
        lines.append(json.dumps(line))
    jsonl.write_text("\n".join(lines) + "\n")


def _overrides(root, jsonl, *extra):
    base = user_data_overrides(root, *DPO_RUN, "--data.workers=0", *extra)
    base = [o for o in base if not o.startswith("--data.sources")]
    return tiny_job_overrides(root / "run", *base, f'--data.sources=[{{path = "{jsonl}", weight = 1.0}}]')


def test_a_users_pairs_train_each_answer_alone(tmp_path):
    from loom.train.build import build_job
    from loom.train.trainer import Trainer

    jsonl = write_user_data(tmp_path / "dpo", n=12, seed=3)
    _pair_lines(jsonl)
    cfg = load_config("configs/tiny.toml", _overrides(tmp_path, jsonl))
    pair = build_job(cfg).data.train[0]
    chosen, rejected = pair.chosen, pair.rejected
    first = next(i for i, (a, b) in enumerate(zip(chosen.tokens, rejected.tokens)) if a != b)
    assert chosen.tokens[:first] == rejected.tokens[:first]  # one prompt
    for side in (chosen, rejected):  # only the answer (and its end of turn) is a target
        assert not any(side.supervised[:first]) and any(side.supervised[first:])
    result = Trainer(cfg).train_step()
    assert result.loss == pytest.approx(0.6931472, abs=1e-6)  # the policy is the reference: −log σ(0)
    assert result.metrics["reward_margin"] == 0 and result.metrics["accuracy"] == 0


@pytest.mark.parametrize("edit, message", [
    (lambda i, line: line.update(rejected=line["chosen"]) if i == 2 else None,
     r'data\.jsonl:3: "chosen" and "rejected" are identical'),
    (lambda i, line: line.pop("rejected") if i == 1 else None, r'data\.jsonl:2: has "chosen" but no "rejected"'),
    (lambda i, line: [line.pop("chosen"), line.pop("rejected"), line["messages"].append(
        {"role": "assistant", "content": "red"})] if i == 4 else None,
     r"data\.jsonl:5: no \"chosen\" and \"rejected\": train.objective = 'dpo' needs a pair on every line"),
    (lambda i, line: line.update(rejected=line["chosen"] + " " * 3000) if i == 0 else None,
     r"data\.jsonl:1: the DPO pair's answers need .* tokens together"),
])
def test_a_bad_pair_is_named_before_any_weight_is_read(tmp_path, monkeypatch, edit, message):
    import loom.train.build as build
    from loom.train.build import build_job

    jsonl = write_user_data(tmp_path / "dpo", n=6, seed=3)
    _pair_lines(jsonl, edit)
    monkeypatch.setattr(build, "initial_weights", lambda *a: pytest.fail("a weight was read before the data check"))
    with pytest.raises(BadSample, match=message):
        build_job(load_config("configs/tiny.toml", _overrides(tmp_path, jsonl, "--data.tokens_per_microbatch=256")))


def test_a_pair_under_another_objective_is_named(tmp_path):
    from loom.train.build import build_job

    jsonl = write_user_data(tmp_path / "dpo", n=6, seed=3)
    _pair_lines(jsonl)
    overrides = [o for o in _overrides(tmp_path, jsonl) if not o.startswith(("--train.objective", "--train.ref"))]
    with pytest.raises(BadSample, match=r"data\.jsonl:1: a DPO pair .* but train.objective = 'sft'"):
        build_job(load_config("configs/tiny.toml", overrides))
