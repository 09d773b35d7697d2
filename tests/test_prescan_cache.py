"""data.prescan_cache (loom/train/prescan_cache.py): a start on the same files under the same config reads every
line's findings back instead of checking any line; another config, an edited source or an unreadable cache file
scans again; a cached shape the sample no longer renders to stops the step naming its line."""

from __future__ import annotations

import json

import pytest
from test_prescan_share import _prescanned, _user

from loom.data.conversations import BadSample

KEPT = ("measured", "positions", "bad")


def _start(root, *extra: str) -> dict:
    return _prescanned(_user(root, "--data.prescan_cache=true", *extra), str(root / "run"))


def _caches(root) -> list:
    return sorted((root / "data").glob("data.jsonl.prescan-*.json"))


def test_a_second_start_checks_no_line_and_finds_the_same(tmp_path):
    first = _start(tmp_path, "--data.on_bad_sample=skip")
    assert len(first["checked"]) == 32 and len(_caches(tmp_path)) == 1
    again = _start(tmp_path, "--data.on_bad_sample=skip", "--data.seed=7")  # a key the prescan does not read
    assert again["checked"] == [] and {k: again[k] for k in ("measured", "bad")} == {k: first[k] for k in
                                                                                    ("measured", "bad")}


def test_another_config_an_edited_source_or_a_broken_cache_scans_again(tmp_path):
    _start(tmp_path)
    assert len(_start(tmp_path, "--data.train_on=all")["checked"]) == 32  # the targets change: its own file
    assert len(_caches(tmp_path)) == 2
    for cache in _caches(tmp_path):
        cache.write_text("{not json")
    assert len(_start(tmp_path)["checked"]) == 32
    jsonl = tmp_path / "data" / "data.jsonl"
    lines = jsonl.read_text().splitlines()
    jsonl.write_text("\n".join(lines[:-1]) + "\n")  # a line fewer: another size
    assert len(_start(tmp_path)["checked"]) == 31


def test_a_shape_the_sample_no_longer_renders_to_stops_the_step_naming_its_line(tmp_path):
    from loom.job import load_config
    from conftest import tiny_job_overrides
    from loom.train.trainer import Trainer

    _start(tmp_path)
    (cache,) = _caches(tmp_path)
    saved = json.loads(cache.read_text())
    for seqs in saved["shapes"]:
        seqs[0][0] += 1  # every sample one token longer than it renders: as if its media changed in place
    cache.write_text(json.dumps(saved))
    t = Trainer(load_config(None, tiny_job_overrides(tmp_path / "run", *_user(tmp_path, "--data.prescan_cache=true"))))
    with pytest.raises(BadSample, match=r"data\.jsonl:\d+: renders to \d+ tokens .* did its file change since"):
        t.train_step()


def test_every_rank_reads_the_cache_and_gathers_nothing(worlds, tmp_path_factory):
    from test_prescan_share import _gathers

    root = tmp_path_factory.mktemp("prescan-cache")
    user = _user(root, "--data.prescan_cache=true")
    first = worlds.run(2, _prescanned, user, str(root / "run"), timeout=180)
    assert len(_caches(root)) == 1 and first[0]["measured"] == first[1]["measured"]
    again = worlds.run(2, _prescanned, user, str(root / "run"), timeout=180)
    assert [r["checked"] for r in again] == [[], []] and again[0]["measured"] == first[0]["measured"]
    assert worlds.run(2, _gathers, user, str(root / "run"), timeout=180) == [["all_reduce"]] * 2
