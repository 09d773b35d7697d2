"""A rank's host work per step is its own share's (loom/train/step_data.py, issue 50): it plans the whole global
batch from the shapes the prescan measured, renders only the samples its LLM and encoder replicas take, agrees
on bad samples with one all-reduce in a step where none was found, and a sample found bad at render by the one
rank that renders it stops, or is skipped by, every rank alike."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import pytest
from conftest import tiny_job_overrides, user_data_overrides

from loom.data.conversations import BadSample
from loom.job import load_config

STEPS = 3


@contextmanager
def _patched(owner, name: str, wrap):
    """owner.name replaced by wrap(original) for the block: a world's rank process outlives the test."""
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _rendering(log: list[int], broken: int | None = None):
    """ConversationSamples.__getitem__ that logs each index rendered, and fails to render `broken`."""
    def wrap(original):
        def getitem(self, i):
            log.append(i)
            if i == broken:
                raise BadSample(f"{self.where(i)}: broken at render")
            return original(self, i)
        return getitem
    return wrap


def _counting(log: list[str], name: str):
    def wrap(original):
        def call(*args, **kwargs):
            log.append(name)
            return original(*args, **kwargs)
        return call
    return wrap


def _share_work(overrides: list[str], out: str) -> dict:
    """On each rank: the indices it renders in STEPS steps, the data group's collectives of each step, and what a
    sample broken at render (step 0's first, rendered by one rank) does under "error" and under "skip"."""
    import torch.distributed as dist

    from loom.data.source import BadSamples, ConversationSamples
    from loom.train.step_data import step_inputs
    from loom.train.trainer import Trainer

    t = Trainer(load_config(None, tiny_job_overrides(out, *overrides), world_size=dist.get_world_size()))
    t.prefetch.close()

    def inputs(step: int, cfg=t.cfg, bad=None):
        return step_inputs(t.batches, step, t.plan, cfg, t.tok, t.counters, t.device, bad)

    rendered, collectives = [], []
    with _patched(ConversationSamples, "__getitem__", _rendering(rendered)), \
            _patched(dist, "all_reduce", _counting(collectives, "all_reduce")), \
            _patched(dist, "all_gather_object", _counting(collectives, "all_gather_object")):
        steps = []
        for step in range(STEPS):
            rendered.clear(), collectives.clear()
            got = inputs(step)
            steps.append({"rendered": list(rendered), "collectives": list(collectives), "indices": got.indices})
    broken = t.batches.indices(0)[0]
    out = {"steps": steps, "broken": broken, "global": [t.batches.indices(s) for s in range(STEPS)]}
    rendered = []
    with _patched(ConversationSamples, "__getitem__", _rendering(rendered, broken)), \
            _patched(dist, "all_reduce", _counting(collectives, "all_reduce")), \
            _patched(dist, "all_gather_object", _counting(collectives, "all_gather_object")):
        collectives.clear()
        error = dataclasses.replace(t.cfg, data=dataclasses.replace(t.cfg.data, on_bad_sample="error"))
        with pytest.raises(BadSample) as stopped:
            inputs(0, error)
        out["error"], out["error_collectives"] = str(stopped.value), list(collectives)
        out["rendered_broken"] = broken in rendered
        skip = dataclasses.replace(t.cfg, data=dataclasses.replace(t.cfg.data, on_bad_sample="skip"))
        skipped = BadSamples()
        out["skip_indices"] = inputs(0, skip, skipped).indices
        out["skipped"] = dict(skipped.found)
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_rank_renders_its_share_and_agrees_with_one_all_reduce(worlds, tmp_path_factory, ranks):
    """LLM and encoders dp = ranks (one replica each): every sample of a step is rendered by exactly one rank,
    a rank renders global batch / ranks of them, and a step with nothing bad costs the data group one all-reduce."""
    root = tmp_path_factory.mktemp(f"share{ranks}")
    user = user_data_overrides(root, "--data.heldout_size=2", "--train.global_batch_size=8", "--data.workers=0")
    results = worlds.run(ranks, _share_work, user, str(root / "run"), timeout=240)
    for step in range(STEPS):
        batch = results[0]["global"][step]
        renders = [r["steps"][step]["rendered"] for r in results]
        assert all(len(mine) == len(batch) // ranks for mine in renders), renders  # its share, each once
        assert sorted(i for mine in renders for i in mine) == sorted(batch)  # every sample by exactly one rank
        assert all(r["steps"][step]["collectives"] == ["all_reduce"] for r in results)
        assert all(r["steps"][step]["indices"] == results[0]["steps"][step]["indices"] for r in results)


def test_a_sample_broken_at_render_on_one_rank_stops_or_is_skipped_by_every_rank(worlds, tmp_path_factory):
    root = tmp_path_factory.mktemp("render-bad")
    user = user_data_overrides(root, "--data.heldout_size=2", "--train.global_batch_size=8", "--data.workers=0")
    results = worlds.run(2, _share_work, user, str(root / "run"), timeout=240)
    broken = results[0]["broken"]
    assert [r["rendered_broken"] for r in results].count(True) == 1  # found by the one rank that renders it
    assert results[0]["error"] == results[1]["error"] and results[0]["error"].endswith(": broken at render")
    # the count said something was found: the samples were gathered once
    assert all(r["error_collectives"] == ["all_reduce", "all_gather_object"] for r in results)
    assert results[0]["skipped"] == results[1]["skipped"] and len(results[0]["skipped"]) == 1
    assert results[0]["skip_indices"] == results[1]["skip_indices"] and broken not in results[0]["skip_indices"]
