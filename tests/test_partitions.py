"""topology/partitions.py's two paths, by what each hands torch: `split_group` (NCCL with a bound device, not on this
CPU machine, so torch's functions are replaced by recorders) gets only this rank's set, or another one when the rank
is in none; the enumeration gets every set. The real paths run in tests/test_grid.py (gloo) and
tests/test_scale_sim.py (fake backend)."""

from __future__ import annotations

import torch.distributed as dist

from loom.topology import partitions

SETS = [(0, 1), (2, 3), (4, 5)]


def _recording(monkeypatch, splittable: bool) -> list:
    calls = []
    monkeypatch.setattr(partitions, "can_split", lambda: splittable)
    monkeypatch.setattr(dist, "split_group", lambda **kw: calls.append(("split", kw)) or "mine")
    monkeypatch.setattr(dist, "new_subgroups_by_enumeration",
                        lambda sets, **kw: calls.append(("enumerate", sets, kw)) or ("mine", ["all"]))
    return calls


def test_split_passes_only_this_ranks_set(monkeypatch):
    calls = _recording(monkeypatch, True)
    every = lambda: (_ for _ in ()).throw(AssertionError("the split path must not list every set"))  # noqa: E731
    assert partitions.create_partition(every, (2, 3), SETS[0], desc="language:tp") == "mine"
    assert partitions.create_partition(every, None, SETS[0]) == "mine"  # torch returns None to a non-member
    (_, member), (_, outsider) = calls
    assert member["split_ranks"] == [[2, 3]] and member["group_desc"] == "language:tp"
    assert outsider["split_ranks"] == [[0, 1]] and outsider["group_desc"] is None


def test_another_backend_or_no_split_enumerates_every_set(monkeypatch):
    calls = _recording(monkeypatch, True)
    assert partitions.create_partition(lambda: SETS, (2, 3), SETS[0], backend="gloo") == "mine"  # gloo beside NCCL
    monkeypatch.setattr(partitions, "can_split", lambda: False)
    assert partitions.create_partition(lambda: SETS, None, SETS[0]) is None  # in no set: no group
    assert [(c[0], c[1], c[2]["backend"]) for c in calls] == [("enumerate", [[0, 1], [2, 3], [4, 5]], "gloo"),
                                                           ("enumerate", [[0, 1], [2, 3], [4, 5]], None)]
