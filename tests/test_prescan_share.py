"""The prescan shared over the ranks (loom/train/prescan.py, issue 50): each rank checks and measures every
world-th line, one gather combines them, and every rank ends with what one process reading every line finds —
the same shapes, the same bad lines in the same order, the same first line for "an RL value on every line or on
none"."""

from __future__ import annotations

import json

from conftest import tiny_job_overrides, user_data_overrides, write_user_data

from loom.data.conversations import BadSample
from loom.job import load_config


def _prescanned(overrides: list[str], out: str) -> dict:
    """This rank's lines checked, and the job's data as the prescan left it (or the BadSample it raised)."""
    import torch.distributed as dist

    import loom.train.job_data as job_data
    from loom.train.build import build_job

    checked, prescan = [], job_data.prescan

    def counting(*args, **kwargs):
        check = prescan(*args, **kwargs)
        return lambda conv, source: (checked.append(conv.where), check(conv, source))[1]

    world = dist.get_world_size() if dist.is_initialized() else 1
    job_data.prescan = counting
    try:
        job = build_job(load_config(None, tiny_job_overrides(out, *overrides), world_size=world))
    except BadSample as e:
        return {"checked": checked, "error": str(e)}
    finally:
        job_data.prescan = prescan
    train = job.data.train
    return {"checked": checked, "measured": train.measured, "positions": train.positions, "bad": job.data.bad.found}


def _user(root, *extra: str) -> list[str]:
    return user_data_overrides(root, "--data.heldout_size=2", "--train.global_batch_size=8", "--data.workers=0",
                               *extra)


def test_each_rank_checks_its_share_of_the_lines_and_all_end_with_every_shape(worlds, tmp_path_factory):
    root = tmp_path_factory.mktemp("prescan")
    user = _user(root, "--data.on_bad_sample=skip")
    lines = (root / "data" / "data.jsonl").read_text().splitlines()
    lines[5] = json.dumps({"messages": [{"role": "robot", "content": "hi"}]})  # a bad line, skipped alike
    (root / "data" / "data.jsonl").write_text("\n".join(lines) + "\n")
    alone = worlds.run(1, _prescanned, user, str(root / "run1"), timeout=180)[0]
    shared = worlds.run(2, _prescanned, user, str(root / "run2"), timeout=180)
    assert len(alone["checked"]) == len(lines) - 1  # the bad line does not parse: it reaches no check
    for r, mine in enumerate(shared):
        # its half, and the first line that passes (which primes the check's first-line state) at most once more
        assert len(mine["checked"]) <= (len(lines) + 1) // 2 + 1, (r, mine["checked"])
        assert {k: mine[k] for k in ("measured", "positions", "bad")} == {k: alone[k] for k in ("measured",
                                                                                          "positions", "bad")}
    assert set(shared[0]["checked"]) | set(shared[1]["checked"]) == set(alone["checked"])
    assert len(alone["bad"]) == 1


def test_an_rl_value_on_some_lines_is_found_on_every_line_as_one_process_finds_it(worlds, tmp_path_factory):
    """Line 1 alone has "logprobs": one process names lines 2… against line 1; a rank whose share starts at line 2
    must not take line 2 as its first line (it would find no fault in its share)."""
    root = tmp_path_factory.mktemp("prescan-rl")
    jsonl = write_user_data(root / "rl", n=6, seed=5)
    lines = [json.loads(x) for x in jsonl.read_text().splitlines()]
    for i, line in enumerate(lines):
        line.update(advantage=1.0, **({"logprobs": [-1.0]} if i == 0 else {}))
    jsonl.write_text("".join(json.dumps(x) + "\n" for x in lines))
    user = [o for o in _user(root, "--train.objective=grpo", "--train.global_batch_size=2")
            if not o.startswith("--data.sources")] + [f'--data.sources=[{{path = "{jsonl}", weight = 1.0}}]']
    alone = worlds.run(1, _prescanned, user, str(root / "run1"), timeout=180)[0]
    shared = worlds.run(2, _prescanned, user, str(root / "run2"), timeout=180)
    assert "data.jsonl:2: lacks \"logprobs\" while" in alone["error"]
    assert [r["error"] for r in shared] == [alone["error"]] * 2


def test_a_world_of_several_prescans_with_one_gather(worlds, tmp_path_factory):
    root = tmp_path_factory.mktemp("prescan-gather")
    results = worlds.run(2, _gathers, _user(root), str(root / "run"), timeout=180)
    assert all(r == ["all_gather_object"] for r in results), results


def _gathers(overrides: list[str], out: str) -> list[str]:
    """The collectives the prescan (`scan`) issues on this rank."""
    import torch.distributed as dist

    import loom.train.job_data as job_data

    calls, scan = [], job_data.scan
    names = ("all_gather_object", "all_reduce", "all_gather", "broadcast", "broadcast_object_list", "barrier")
    original = {n: getattr(dist, n) for n in names}

    def counted(*args, **kwargs):
        for name, fn in original.items():
            setattr(dist, name, lambda *a, _n=name, _f=fn, **k: (calls.append(_n), _f(*a, **k))[1])
        try:
            return scan(*args, **kwargs)
        finally:
            for name, fn in original.items():
                setattr(dist, name, fn)

    job_data.scan = counted
    try:
        _prescanned(overrides, out)
    finally:
        job_data.scan = scan
    return calls
