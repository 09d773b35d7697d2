"""Bad data through `loom train` as a user meets it: one clean report from rank 0, exit code 4 (config errors
are 2), no traceback unless LOOM_TRACEBACK=1 — on one process and on N local ranks alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_job_overrides, user_data_overrides

from loom.exit_codes import DATA_ERROR

ROOT = Path(__file__).resolve().parent.parent


def _with_a_bad_line(tmp_path) -> list[str]:
    user = user_data_overrides(tmp_path)
    jsonl = tmp_path / "data" / "data.jsonl"
    lines = jsonl.read_text().splitlines()
    lines[3] = json.dumps({"messages": [{"role": "robot", "content": "hi"}]})
    jsonl.write_text("\n".join(lines) + "\n")
    return tiny_job_overrides(tmp_path / "run", *user)


def _loom(args: list[str], **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, "-m", "loom", "train", "configs/tiny.toml", *args],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_bad_line_is_one_clean_report_and_its_own_exit_code(tmp_path, ranks):
    out = _loom([*_with_a_bad_line(tmp_path), f"--layout.world_size={ranks}"])
    where = f"{tmp_path / 'data' / 'data.jsonl'}:4"
    assert out.returncode == DATA_ERROR, out.stderr
    assert out.stderr.count("loom: data error: 1 bad conversations") == 1, out.stderr  # rank 0 alone
    assert f"{where}: messages[0]: unknown role 'robot'" in out.stderr
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr, out.stderr


def test_loom_traceback_shows_where_a_data_error_was_raised(tmp_path):
    out = _loom([*_with_a_bad_line(tmp_path), "--layout.world_size=1"], LOOM_TRACEBACK="1")
    assert out.returncode == 1 and "Traceback" in out.stderr and "BadSample" in out.stderr


def test_a_config_error_is_one_line_and_exit_2_its_traceback_when_asked():
    plain = _loom(["--train.steps=0"])
    assert plain.returncode == 2 and plain.stderr.startswith("loom: config error: train.steps")
    assert "Traceback" not in plain.stderr
    asked = _loom(["--train.steps=0"], LOOM_TRACEBACK="1")
    assert asked.returncode == 1 and "Traceback" in asked.stderr and "ConfigError: train.steps" in asked.stderr


def test_loom_eval_on_bad_held_out_data_is_a_data_error(tmp_path, monkeypatch, capsys):
    import loom.cli
    import loom.train.checkpoint_eval as checkpoint_eval
    from loom.data.conversations import BadSample

    def bad(*args, **kwargs):
        raise BadSample("held.jsonl:3: messages[0]: unknown role 'robot'")

    monkeypatch.setattr(checkpoint_eval, "evaluate_checkpoint", bad)
    assert loom.cli.main(["eval", str(tmp_path)]) == DATA_ERROR
    assert capsys.readouterr().err == "loom eval: data error: held.jsonl:3: messages[0]: unknown role 'robot'\n"
