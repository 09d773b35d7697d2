"""Steps prepared ahead by DataLoader workers (loom/train/step_data.py): a step a worker plans is the step the
main process would plan, bit for bit, from any starting step (a resume), out of order, and after a sample is
dropped; a run with workers trains exactly as one without, bad files skipped alike on every rank."""

from __future__ import annotations

import torch
from conftest import tiny_job_overrides, user_data_overrides
from test_user_data import _truncate

from loom.job import load_config
from loom.train.inputs import StepInputs
from loom.train.step_data import StepPrefetcher, plan_step


def _trainer(tmp_path, *extra: str):
    from loom.train.trainer import Trainer

    overrides = user_data_overrides(tmp_path, "--data.heldout_size=2", "--train.global_batch_size=6", *extra)
    return Trainer(load_config(None, tiny_job_overrides(tmp_path / "run", *overrides)))


def _tensors(inputs: StepInputs) -> list[torch.Tensor]:
    out = []
    for m in inputs.microbatches:
        b = m.llm
        out += [b.input_ids, b.labels, b.positions, b.spans.cu_seqlens]
        out += [x for name in sorted(m.encoder_items) for x in m.encoder_items[name]]
    return out


def _same(a: StepInputs, b: StepInputs) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return (a.indices == b.indices and a.failed == b.failed and a.supervised == b.supervised
            and len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb)))


def test_workers_prepare_the_steps_the_main_process_plans_from_any_step(tmp_path):
    t = _trainer(tmp_path)
    plan = lambda s: plan_step(t.batches, s, t.cfg, t.tok, t.counters, t.plan.shares, t.plan.sample_multiple)  # noqa: E731
    ahead = StepPrefetcher(t.batches, plan, last=8, workers=2, prefetch_steps=2, pin=False)
    try:
        for step in (3, 4, 5, 1, 2):  # a resume at 3, then a step out of order: the workers restart there
            got = ahead.get(step)
            assert got.indices == t.batches.indices(step) and _same(got, plan(step)), step
        assert any(m.encoder_items.get("vision") for m in got.microbatches)  # media were decoded by the worker
        t.batches.drop(t.batches.indices(3)[0])  # a sample found bad: later steps leave it out
        for step in (3, 4):
            got = ahead.get(step)
            assert t.batches.indices(3)[0] not in got.indices and _same(got, plan(step))
    finally:
        ahead.close()
    assert StepPrefetcher(t.batches, plan, 8, workers=0, prefetch_steps=2, pin=False).get(0) is None  # in step


def _losses(overrides: list[str], out: str) -> tuple[list[float], list[str]]:
    import torch.distributed as dist

    from loom.train.trainer import Trainer

    t = Trainer(load_config(None, tiny_job_overrides(out, *overrides), world_size=dist.get_world_size()))
    losses = [t.train_step().loss for _ in range(4)]
    t.prefetch.close()
    return losses, sorted(t.data.bad.found)


def test_a_run_with_workers_is_the_run_without_skipping_the_same_files(worlds, tmp_path_factory):
    """vision dp2 on 2 ranks, a truncated image in some steps (found by the one rank that decodes it),
    data.on_bad_sample = "skip": the losses and the skipped files are the same with 0 and 2 workers."""
    root = tmp_path_factory.mktemp("workers")
    user = user_data_overrides(root, "--data.heldout_size=2", "--train.global_batch_size=6",
                               "--data.on_bad_sample=skip")
    for i in (1, 9, 14):
        _truncate(root / "data" / "media" / f"{i}.png")
    runs = {w: worlds.run(2, _losses, [*user, f"--data.workers={w}"], str(root / f"run{w}"), timeout=180)
            for w in (0, 2)}
    assert runs[0][0] == runs[0][1] and runs[2][0] == runs[2][1]  # every rank: the same losses, the same skips
    assert runs[0][0] == runs[2][0]
    assert runs[0][0][1], "no truncated image was drawn: the test would not reach the agreement"
