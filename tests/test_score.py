"""`loom score`'s computation (loom/rl/score.py): per-token logprobs, entropy and top-k of held-out samples
under a layout equal the one-process reference model's (same initial weights) to 1e-5, top-k ids equal,
samples in input order — tp (vocab-parallel), cp (load-balanced shards), pp, a fan-in and non-colocated
encoders; and on one process, against torch's log-softmax of the model's own logits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loom.job import load_config

BASE = ["--train.global_batch_size=4", "--data.train_size=64", "--data.heldout_size=6"]
K = 4


def _scores(overrides: list[str]) -> dict:
    from loom.rl.score import score_samples
    from loom.train.build import build_job
    from loom.train.rank_plan import one_process_plan

    world = dist.get_world_size() if dist.is_initialized() else None
    job = build_job(load_config(None, BASE + overrides, world_size=world), reference=True)
    samples = job.data.heldout
    mine = score_samples(job.plan, job.model, samples, job.cfg, job.tok, job.counters, job.device, K, 0.8)
    modules = [*job.reference.encoder_names, "language"]
    ref_plan = one_process_plan(modules, job.plan.sample_multiple, "fp32", job.device)
    ref = score_samples(ref_plan, job.reference, samples, job.cfg, job.tok, job.counters, job.device, K, 0.8)
    diff = {"logprobs": 0.0, "entropy": 0.0, "top_k_logits": 0.0}
    same_ids = True
    for a, b in zip(mine, ref):
        assert a.targets == b.targets and len(a.targets) > 0
        for name in diff:
            x, y = torch.tensor(getattr(a, name)), torch.tensor(getattr(b, name))
            diff[name] = max(diff[name], (x - y).abs().max().item())
        same_ids &= a.top_k_ids == b.top_k_ids
    return {**diff, "same_ids": same_ids, "n": len(mine), "targets": [s.targets for s in mine]}


def placed(encoders: str, llm: str) -> list[str]:
    return [f"--layout.vision.ranks={encoders}", f"--layout.audio.ranks={encoders}", f"--layout.language.ranks={llm}"]


LAYOUTS = {
    "dp2": (2, []),
    "tp2": (2, ["--layout.vision.tp=2", "--layout.audio.tp=2", "--layout.language.tp=2"]),
    "cp2": (2, ["--layout.language.cp=2", "--data.pad_to_multiple=4"]),
    "pp2-mb2": (2, ["--layout.language.pp=2", "--train.microbatches=2", "--data.tokens_per_microbatch=512"]),
    "pp2xtp2": (4, ["--layout.vision.tp=2", "--layout.audio.tp=2", "--layout.language.tp=2", "--layout.language.pp=2",
                    "--train.microbatches=2", "--data.tokens_per_microbatch=512"]),
    "fan-in-llm-tp2xcp2": (4, ["--layout.vision.tp=1", "--layout.language.tp=2", "--layout.language.cp=2",
                               "--data.pad_to_multiple=8"]),
    "noncolocated-llm-dp2": (3, placed("0-0", "1-2")),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_scores_under_a_layout_equal_the_one_process_model(worlds, name):
    world, overrides = LAYOUTS[name]
    per_rank = worlds.run(world, _scores, overrides, timeout=300)
    for rank, r in enumerate(per_rank):
        assert r["n"] == 6 and r["same_ids"], (name, rank, r)
        assert max(r["logprobs"], r["entropy"], r["top_k_logits"]) < 1e-5, (name, rank, r)
        assert r["targets"] == per_rank[0]["targets"], f"{name}: rank {rank} got other samples"


def test_one_process_scores_are_the_model_s_log_softmax(tok, tiny_model):
    """The scores of one packed batch of two samples equal log_softmax(logits / T) at each target, the
    entropy of that distribution and its top k, sample by sample in input order."""
    from conftest import text_sample

    from loom.data.packing import pack_samples
    from loom.rl.score import score_samples
    from loom.train.rank_plan import one_process_plan

    cfg = load_config(None, ["--train.global_batch_size=2", "--data.format=thd"])
    samples = [text_sample(list(range(10, 30)), 6), text_sample(list(range(40, 52)), 3)]
    plan = one_process_plan(["vision", "audio", "language"], 1, "fp32", torch.device("cpu"))
    counters = {n: tiny_model.encoder(n).num_tokens for n in tiny_model.encoder_names}
    scores = score_samples(plan, tiny_model, samples, cfg, tok, counters, torch.device("cpu"), 3, 0.5)
    for s, got in zip(samples, scores):
        batch = pack_samples([s], tok.pad_id)
        with torch.no_grad():
            logp = F.log_softmax(tiny_model.language(batch.input_ids, batch.positions, batch.spans, {}) / 0.5, -1)
        targets = [t for t, sup in zip(s.tokens[1:], s.supervised[1:]) if sup]
        at = [i for i in range(len(s) - 1) if s.supervised[i + 1]]
        assert got.targets == targets
        torch.testing.assert_close(torch.tensor(got.logprobs), logp[at, targets], rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(got.entropy), -(logp[at].exp() * logp[at]).sum(-1), rtol=0, atol=1e-5)
        assert got.top_k_ids == logp[at].topk(3, -1).indices.tolist()


def test_loom_score_writes_every_conversation_in_order(tmp_path, capsys):
    """`loom score CONFIG --data FILE --out DIR`: one line per conversation of FILE, in its order, each target
    scored (a logprob ≤ 0, an entropy ≥ 0, the top k); with --checkpoint the trained weights score higher
    on the data they were trained on. A config on built-in tasks is refused with the key to set."""
    import json

    import loom.cli
    from conftest import tiny_job_overrides, user_data_overrides, write_user_data

    data = write_user_data(tmp_path / "score", n=5, seed=3)
    base = tiny_job_overrides(tmp_path / "run", *user_data_overrides(tmp_path), "--score.top_k=3")
    out = tmp_path / "scores"
    assert loom.cli.main(["score", "configs/tiny.toml", f"--data={data}", f"--out={out}", *base]) == 0
    lines = [json.loads(x) for x in (out / "scores.jsonl").read_text().splitlines()]
    assert [x["index"] for x in lines] == list(range(5))
    assert [x["where"].rsplit(":", 1)[-1] for x in lines] == ["1", "2", "3", "4", "5"]
    for x in lines:
        assert x["targets"] and len(x["logprobs"]) == len(x["targets"]) == len(x["top_k_ids"])
        assert all(lp <= 0 for lp in x["logprobs"]) and all(h >= 0 for h in x["entropy"])
        assert all(len(ids) == 3 for ids in x["top_k_ids"])
    from loom.job import load_config
    from loom.train.trainer import Trainer

    Trainer(load_config("configs/tiny.toml", [*base, "--train.lr=1e-2"])).run()  # 5 steps, then step-5
    trained = tmp_path / "trained"
    assert loom.cli.main(["score", "configs/tiny.toml", f"--data={data}", f"--out={trained}",
                          f"--checkpoint={tmp_path / 'run' / 'step-5'}", *base]) == 0
    after = [json.loads(x) for x in (trained / "scores.jsonl").read_text().splitlines()]
    assert sum(sum(x["logprobs"]) for x in after) > sum(sum(x["logprobs"]) for x in lines)
    capsys.readouterr()
    assert loom.cli.main(["score", "configs/tiny.toml", f"--data={data}", f"--out={out}"]) == 2
    assert "data.sources" in capsys.readouterr().err
