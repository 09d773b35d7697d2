"""What a run reports besides the console: metrics.jsonl, and Weights & Biases next to it (run.wandb)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import types

import pytest

import loom.cli
from loom.job import load_config
from loom.typed_config import ConfigError

TINY = ["--train.steps=2", "--data.heldout_size=6", "--run.tensorboard=false", "--train.eval_max_new_tokens=2",
        "--run.progress=false"]


class _FakeRun:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def log(self, values: dict, step: int) -> None:
        self.calls.append(("log", step, values))

    def finish(self) -> None:
        self.calls.append(("finish",))


def test_wandb_gets_every_metric_of_metrics_jsonl_at_its_step(tmp_path, monkeypatch):
    calls: list = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or _FakeRun(calls)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "wandb" else None)
    out = tmp_path / "my-run"
    assert loom.cli.main(["train", "configs/tiny.toml", *TINY, f"--run.out_dir={out}", "--run.wandb=true",
                          "--run.wandb_project=proj", "--run.wandb_mode=offline"]) == 0
    init = calls[0][1]
    assert (init["project"], init["mode"], init["name"], init["dir"]) == ("proj", "offline", "my-run", str(out))
    assert init["config"]["train"]["steps"] == 2 and init["config"]["run"]["wandb"] is True
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    want = [("log", r["step"], {f"{r['kind']}/{k}": v for k, v in r.items() if k not in ("step", "kind")})
            for r in records]
    assert calls[1:] == [*want, ("finish",)]
    assert {"train/loss", "train/grad_norm"} <= calls[1][2].keys() and "heldout/token_accuracy" in calls[-2][2]


def test_run_wandb_without_the_package_is_a_config_error_naming_the_key(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"run\.wandb = true needs the wandb package.*pip install 'loom\[wandb\]'"):
        load_config("configs/tiny.toml", ["--run.wandb=true"])  # before any rank reads a weight


def test_wandb_offline_writes_a_run_without_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert loom.cli.main(["train", "configs/tiny.toml", *TINY, f"--run.out_dir={out}", "--run.wandb=true",
                          "--run.wandb_mode=offline"]) == 0
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")  # what `wandb sync` uploads later
    keys = (b"train/loss", b"heldout/exact_match", b"global_batch_size")
    for _ in range(60):  # wandb's service process writes the file: on a loaded machine, after finish() returns
        written = run_file.read_bytes()
        if all(key in written for key in keys):
            break
        time.sleep(0.5)
    assert all(key in written for key in keys), [k for k in keys if k not in written]
