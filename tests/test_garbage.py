"""train/garbage.py: under a layout Python's collector runs at fixed steps on every rank, not when one rank's
allocations say so."""

from __future__ import annotations

import gc

from loom.train.garbage import collect_at


def test_collections_at_fixed_steps_only(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a))
    was = gc.isenabled()
    try:
        gc.enable()
        for step in range(7):
            collect_at(step, 3)
        assert not gc.isenabled()  # off between the fixed steps
        assert len(calls) == 3  # steps 0, 3 and 6
        gc.enable()
        collect_at(5, 0)  # 0: Python's own schedule, untouched
        assert gc.isenabled() and len(calls) == 3
    finally:
        gc.enable() if was else gc.disable()
