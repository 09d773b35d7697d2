"""`run.async_save`'s host copies (loom/checkpoint/staging.py): the files equal a sync save's of the same step
even when the training changes every tensor before a byte is written; each shard is copied once per save, into
host buffers the next save reuses (torch's staging allocated fresh pageable tensors at every save, 16 s of the
2B job's 29 s async save on one H100)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.nn as nn

from loom.checkpoint import staging as host_staging
from loom.checkpoint.sharded import begin_save
from loom.checkpoint.staging import HostStaging, slab_plan
from loom.checkpoint.writer import StreamingHFWriter


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 32), nn.Linear(32, 8, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 48)).square().sum().backward()
    opt.step()
    return model, opt


def _shard_files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.glob("*model-*.safetensors"))}


def _train_on(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """What the next step does to the saved tensors: weights and moments changed in place."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        for state in opt.state.values():
            state["exp_avg"].mul_(3.0)
            state["step"].add_(1.0)


def test_an_async_save_writes_the_step_it_was_asked_for_even_if_training_changes_everything_first(
        tmp_path, monkeypatch):
    model, opt = _trained()
    begin_save(tmp_path / "sync", model, opt, {}, 1, {}).finish()
    release, write_data = threading.Event(), StreamingHFWriter.write_data

    def held_back(self, plan, planner):  # no byte is written until the training has changed every tensor
        assert release.wait(60)
        return write_data(self, plan, planner)

    monkeypatch.setattr(StreamingHFWriter, "write_data", held_back)
    pending = begin_save(tmp_path / "async", model, opt, {}, 1, {}, run_async=True)
    _train_on(model, opt)
    release.set()
    pending.finish()
    sync, written = _shard_files(tmp_path / "sync"), _shard_files(tmp_path / "async")
    assert list(written) == list(sync) and len(sync) >= 2
    assert all(written[name] == sync[name] for name in sync)  # byte for byte: headers and values


def test_async_saves_copy_each_shard_once_into_host_buffers_they_reuse(tmp_path):
    model, opt = _trained()
    staging = HostStaging()
    shards = 3 + 3 * 3  # 3 parameters, and each one's two moments and step count
    begin_save(tmp_path / "a", model, opt, {}, 1, {}, run_async=True, staging=staging).finish()
    slabs = [s.data_ptr() for s in staging.slabs]
    assert staging.layouts == 1 and staging.copies == shards and len(staging.host) == shards
    _train_on(model, opt)
    begin_save(tmp_path / "b", model, opt, {}, 2, {}, run_async=True, staging=staging).finish()
    assert staging.layouts == 1 and staging.copies == 2 * shards  # no new buffers, one copy per shard again
    assert [s.data_ptr() for s in staging.slabs] == slabs
    begin_save(tmp_path / "sync", model, opt, {}, 2, {}).finish()
    assert _shard_files(tmp_path / "b") == _shard_files(tmp_path / "sync")
    assert _shard_files(tmp_path / "a") != _shard_files(tmp_path / "b")


def test_a_save_waits_for_the_previous_write_before_reusing_its_buffers(tmp_path, monkeypatch):
    """Two saves with no finish between them: the second's copies wait for the first's write from the buffers."""
    model, opt = _trained()
    begin_save(tmp_path / "sync", model, opt, {}, 1, {}).finish()
    staging, release, write_data = HostStaging(), threading.Event(), StreamingHFWriter.write_data
    monkeypatch.setattr(StreamingHFWriter, "write_data",
                        lambda self, plan, planner: (release.wait(60), write_data(self, plan, planner))[1])
    first = begin_save(tmp_path / "a", model, opt, {}, 1, {}, run_async=True, staging=staging)
    _train_on(model, opt)
    threading.Timer(0.5, release.set).start()  # the second save's copies could overwrite the buffers meanwhile
    second = begin_save(tmp_path / "b", model, opt, {}, 2, {}, run_async=True, staging=staging)
    first.finish()
    second.finish()
    assert _shard_files(tmp_path / "a") == _shard_files(tmp_path / "sync")


def test_slabs_are_powers_of_two_and_hold_every_shard_apart(monkeypatch):
    monkeypatch.setattr(host_staging, "SLAB", 4096)
    sizes = {"big": 5000, "a": 3000, "b": 1000, "c": 100, "d": 4, "e": 1}
    slabs, place = slab_plan(sizes)
    assert all(n & (n - 1) == 0 for n in slabs) and slabs[0] == 8192  # the shard larger than SLAB: its own
    assert all(n <= 4096 for n in slabs[1:])
    ranges = sorted((k, at, at + sizes[name]) for name, (k, at) in place.items())
    assert all(at % host_staging.ALIGN == 0 and end <= slabs[k] for k, at, end in ranges)
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(ranges, ranges[1:]))  # no two overlap
    assert slab_plan({"x": 100}) == ([128], {"x": (0, 0)})  # a small model: a small slab
