"""Held-out loss and token accuracy under the training layout (train/heldout.py): a forward-only pass on
every rank gives, on every rank, the metrics one process computes on the same weights — by its own,
independent path (one packed batch per task through the whole model)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_job_overrides

from loom.job import load_config

NONCOLOCATED = ["--layout.vision.ranks=0-1", "--layout.audio.ranks=0-1", "--layout.language.ranks=2-3",
                "--train.microbatches=2", "--data.tokens_per_microbatch=512"]
LAYOUTS = {
    "vision-tp2-llm-cp2": ["--layout.vision.tp=2", "--layout.language.cp=2"],
    "llm-tp2-sp-loss-parallel": ["--layout.language.tp=2", "--layout.language.sequence_parallel=true",
                                 "--data.pad_to_multiple=2"],
    "encoders-dp4-llm-pp2xdp2-1f1b": ["--layout.language.pp=2", "--parallel.pp_schedule=1f1b",
                                      "--train.microbatches=2", "--data.tokens_per_microbatch=512"],
    # non-colocated: encoders on ranks 0-1 (fan-in), the LLM on 2-3, cp2 receiving; then pipelined
    "noncolocated-llm-cp2": NONCOLOCATED + ["--layout.language.cp=2"],
    "noncolocated-llm-pp2": NONCOLOCATED + ["--layout.language.pp=2", "--parallel.pp_schedule=1f1b"],
    # one held-out example per task: an LLM replica (a cp pair) gets no sample in each global batch
    "llm-cp2-replicas-without-samples": ["--layout.language.cp=2", "--data.heldout_size=3"],
}


def _one_process_metrics(model, samples, tok) -> dict[str, float]:
    from loom.data.batch import IGNORE_INDEX
    from loom.data.packing import pack_samples
    from loom.train.loss import token_loss_sum

    out, totals = {}, [0.0, 0.0, 0]
    for task in sorted({s.task for s in samples}):
        batch = pack_samples([s for s in samples if s.task == task], tok.pad_id)
        with torch.no_grad():
            logits = model(batch.input_ids, batch.positions, batch.spans, batch.modality_inputs)
        supervised = batch.labels != IGNORE_INDEX
        loss = float(token_loss_sum(logits, batch.labels))
        hits = int(((logits.argmax(-1) == batch.labels) & supervised).sum())
        n = int(supervised.sum())
        out[f"loss/{task}"], out[f"token_accuracy/{task}"] = loss / n, hits / n
        totals = [totals[0] + loss, totals[1] + hits, totals[2] + n]
    out["loss"], out["token_accuracy"] = totals[0] / totals[2], totals[1] / totals[2]
    return out


def _heldout_under_layout(overrides: list[str]) -> dict:
    """On every rank: 3 training steps under the layout, then the held-out metrics under it, and those of one
    process on the layout's weights gathered whole."""
    import torch.distributed as dist

    from loom.data.tokenizer import ByteTokenizer
    from loom.parallel.materialize import materialize
    from loom.train.build import build_batches, build_job_model, initial_weights, setup_parallel
    from loom.train.build import token_counters
    from loom.train.step_data import step_inputs
    from loom.train.job_data import build_job_data
    from loom.train.heldout import heldout_metrics
    from loom.train.optim import ModuleOptimizers
    from loom.train.verify import parameters

    cfg = load_config(None, tiny_job_overrides("/tmp/unused", "--data.heldout_size=12", "--train.lr=1e-2", *overrides),
                      world_size=dist.get_world_size())
    tok, model = ByteTokenizer(), build_job_model(cfg, ByteTokenizer())
    weights = initial_weights(model, cfg)
    reference = build_job_model(cfg, tok)
    counters = token_counters(reference)
    plan = setup_parallel(model, cfg, torch.device("cpu"), weights)
    optimizer = ModuleOptimizers(model, list(plan.hosted), cfg.train)
    data = build_job_data(cfg, tok, counters)
    batches = build_batches(cfg, data)
    for step in range(3):  # trained weights: token accuracy well away from 0
        plan.train_step(model, optimizer, step_inputs(batches, step, plan, cfg, tok, counters, torch.device("cpu")),
                        cfg, step)
    mine = heldout_metrics(plan, model, data.heldout, cfg, tok, counters, torch.device("cpu"))
    materialize(reference, torch.device("cpu"), weights)
    held = [None] * dist.get_world_size()  # a pipelined LLM: each rank holds its stages' weights
    dist.all_gather_object(held, parameters(model))
    reference.load_state_dict({k: v for h in held for k, v in h.items()}, strict=False)  # the layout's, whole
    return {"layout": mine, "one_process": _one_process_metrics(reference, data.heldout, tok)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_heldout_metrics_under_a_layout_equal_one_process(worlds, name):
    per_rank = worlds.run(4, _heldout_under_layout, LAYOUTS[name], timeout=300)
    want = per_rank[0]["one_process"]
    assert set(want) == {"loss", "token_accuracy"} | {f"{k}/{t}" for k in ("loss", "token_accuracy")
                                                        for t in ("digits", "shapes", "tones")}
    if "--data.heldout_size=3" not in LAYOUTS[name]:
        assert 0 < want["token_accuracy"] < 1  # some right, some wrong: a comparison of counts that can differ
    for rank, r in enumerate(per_rank):
        assert r["layout"].keys() == want.keys(), rank
        for key, value in want.items():
            if key.startswith("token_accuracy"):
                assert r["layout"][key] == value, (name, rank, key, r["layout"][key], value)
            else:
                assert r["layout"][key] == pytest.approx(value, rel=1e-6, abs=1e-7), (name, rank, key)


def _hits_of_vocab_sharded_logits() -> tuple[int, int]:
    """On 2 ranks: predicted_hits of logits split over the vocabulary (as loss parallel leaves them), and the
    count on the whole logits. Labels are tp rank 0's own best, which is the overall best only for some
    tokens; rows 0-1 tie across the two halves (the lower index wins, as torch.argmax picks)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from loom.train.heldout import predicted_hits

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 10, generator=g)
    logits[0, 7], logits[0, 2] = 9.0, 9.0  # a tie between the halves: index 2 wins
    logits[1, 1], logits[1, 8] = 9.0, 9.0
    labels = logits[:, :5].argmax(-1)  # the first half's best
    labels[3] = -100  # not supervised
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = distribute_tensor(logits, mesh, [Shard(-1)])
    return int(predicted_hits(sharded, labels, mesh.get_group())), int(predicted_hits(logits, labels, None))


def test_token_hits_of_vocab_sharded_logits_match_the_whole_argmax(worlds):
    for sharded, whole in worlds.run(2, _hits_of_vocab_sharded_logits, timeout=120):
        assert sharded == whole and 0 < whole < 15
