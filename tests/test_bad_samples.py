"""What a run says about the samples it skipped (data/source.py BadSamples, train/metrics.py): each once, whole."""

from __future__ import annotations

import json

from loom.data.conversations import BadSample
from loom.data.source import BadSamples
from loom.train.metrics import MetricsLogger


def test_bad_samples_jsonl_names_the_line_in_where_only(tmp_path):
    bad = BadSamples()
    where = f"{tmp_path}/data.jsonl:3"
    bad.add(where, str(BadSample(f"{where}: image file 'x.png' not found")))
    bad.write(tmp_path / "bad_samples.jsonl")
    (record,) = [json.loads(x) for x in (tmp_path / "bad_samples.jsonl").read_text().splitlines()]
    assert record == {"where": where, "why": "image file 'x.png' not found"}
    assert bad.summary().count(where) == 1  # the summary still says where, once


def test_a_long_line_is_not_wrapped_in_a_log_that_is_not_a_terminal(tmp_path, capfd):
    log = MetricsLogger(tmp_path, total_steps=1, tensorboard=False, progress=False)
    line = "3 bad samples skipped, e.g. " + "/a/very/long/path" * 12 + "/data.jsonl:3: image file not found"
    log.print(line)
    log.close()
    assert line in capfd.readouterr().err.splitlines()
