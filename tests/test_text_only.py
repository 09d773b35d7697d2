"""A text-only job (`model.encoders = []`): the built-in `sums` task or a user's JSONL conversations train with
no encoder module at all — nothing built, nothing run, nothing in the optimizer — and every layout matches the
one-process reference (`loom verify`)."""

from __future__ import annotations

import json

from conftest import tiny_chat_tokenizer, tiny_job_overrides
from oracle import run_verify

from loom.job import load_config

TEXT_ONLY = ["--model.encoders=[]", '--data.tasks=["sums"]']


def _trainer(overrides: list[str]):
    from loom.train.trainer import Trainer

    return Trainer(load_config(None, overrides))


def _assert_no_encoder(trainer) -> None:
    model = trainer.model
    assert model.encoder_names == () and [name for name, _ in model.named_children()] == ["language"]
    assert list(trainer.optimizer.by_module) == ["language"]


def test_the_sums_task_trains_with_no_encoder(tmp_path):
    t = _trainer(tiny_job_overrides(tmp_path / "run", *TEXT_ONLY, "--train.steps=8"))
    _assert_no_encoder(t)
    t.run()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) >= 2 and losses[-1] < losses[0]


def test_a_text_only_jsonl_trains_with_no_encoder(tmp_path):
    (tmp_path / "tok").mkdir()
    tiny_chat_tokenizer(tmp_path / "tok")
    lines = [{"messages": [{"role": "user", "content": f"Count to {i % 7 + 1}"},
                           {"role": "assistant", "content": " ".join(str(k) for k in range(i % 7 + 1))}]}
             for i in range(32)]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    t = _trainer(tiny_job_overrides(tmp_path / "run", "--model.encoders=[]", f"--model.tokenizer={tmp_path / 'tok'}",
                                    f'--data.sources=[{{path = "{tmp_path / "data.jsonl"}", weight = 1.0}}]',
                                    "--data.heldout_size=4"))
    _assert_no_encoder(t)
    t.run()
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def _assert_verified(name: str, per_rank: list[list[dict]], steps: int) -> None:
    for rank, checks in enumerate(per_rank):
        assert len(checks) == steps
        for i, s in enumerate(checks):
            assert s["modules"] == ["language"], f"{name} rank {rank}: {s['modules']}"
            assert s["passed"], f"{name} rank {rank} step {i + 1}: {s['failures']}"
        assert checks == per_rank[0]


def test_a_text_only_job_verifies_at_dp2_with_a_token_budget(worlds):
    results = worlds.run(2, run_verify, [*TEXT_ONLY, "--data.tokens_per_microbatch=64", "--train.microbatches=2"],
                         timeout=240)
    _assert_verified("text dp2", results, steps=3)
