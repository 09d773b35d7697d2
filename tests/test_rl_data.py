"""RL values on a user's JSONL lines (`advantage`, `logprobs`, `ref_logprobs`): the completion is the last
assistant turn, each value lands on its token's label position, and bad lines are named before any weight is
read. End to end: logprobs that `loom score` wrote for the untrained model make GRPO's first ratio 1."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_job_overrides, user_data_overrides, write_user_data

import loom.cli
from loom.data.conversations import BadSample
from loom.job import load_config


def _rewrite(path, edit) -> None:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for i, line in enumerate(lines):
        edit(i, line)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _overrides(root, jsonl, *extra):
    base = user_data_overrides(root, "--train.objective=grpo", "--data.workers=0", *extra)
    base = [o for o in base if not o.startswith("--data.sources")]
    return tiny_job_overrides(root / "run", *base, f'--data.sources=[{{path = "{jsonl}", weight = 1.0}}]')


def test_scored_logprobs_make_the_first_ratio_one(tmp_path):
    from loom.train.trainer import Trainer

    jsonl = write_user_data(tmp_path / "rl", n=12, seed=5)
    _rewrite(jsonl, lambda i, line: line.update(advantage=1.0 if i % 2 else -0.5))
    overrides = _overrides(tmp_path, jsonl)
    out = tmp_path / "scores"
    assert loom.cli.main(["score", "configs/tiny.toml", f"--data={jsonl}", f"--out={out}", *overrides]) == 0
    scores = [json.loads(x) for x in (out / "scores.jsonl").read_text().splitlines()]
    _rewrite(jsonl, lambda i, line: line.update(logprobs=scores[i]["logprobs"]))
    result = Trainer(load_config("configs/tiny.toml", overrides)).train_step()
    assert result.metrics["ratio"] == pytest.approx(1.0, abs=1e-5)
    assert result.metrics["ratio_deviation"] < 1e-5 and result.metrics["clip_fraction"] == 0


@pytest.mark.parametrize("edit, message", [
    (lambda i, line: line.update(advantage=1.0, logprobs=[-1.0] * 50), r'"logprobs" has 50 values, but the completion'),
    (lambda i, line: line.update(advantage=1.0) if i != 3 else None, r'data\.jsonl:4: no "advantage"'),
    (lambda i, line: line.update(advantage=1.0, **({"logprobs": [-1.0]} if i == 0 else {})),
     r'data\.jsonl:2: lacks "logprobs" while .*data\.jsonl:1 has it'),
    (lambda i, line: line.update(advantage="high"), r'"advantage" must be a finite number'),
])
def test_a_bad_rl_line_is_named_before_any_weight_is_read(tmp_path, monkeypatch, edit, message):
    import loom.train.build as build
    from loom.train.build import build_job

    jsonl = write_user_data(tmp_path / "rl", n=6, seed=5)
    _rewrite(jsonl, edit)
    monkeypatch.setattr(build, "initial_weights", lambda *a: pytest.fail("a weight was read before the data check"))
    with pytest.raises(BadSample, match=message):
        build_job(load_config("configs/tiny.toml", _overrides(tmp_path, jsonl)))
