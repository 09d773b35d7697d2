"""What a real cluster does to a run: two launch agents (as on two machines) train and resume together; a
rank that stops answering ends the run with an error naming it instead of a hang."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import tiny_job_overrides

from loom.checkpoint.folders import latest_checkpoint

HETERO = ["--layout.vision.tp=2", "--layout.language.tp=2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_agents(out_dir: Path, *overrides: str) -> list[subprocess.CompletedProcess]:
    """`loom train` under two torchrun agents of 2 ranks each, rendezvous over c10d on localhost — what two
    machines run, `--node-rank` apart."""
    port = _free_port()
    job = tiny_job_overrides(out_dir, *HETERO, *overrides)
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=loom-test",
         "-m", "loom", "train", *job],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) for node in (0, 1)]
    results = []
    for agent in agents:
        out, err = agent.communicate(timeout=400)
        results.append(subprocess.CompletedProcess(agent.args, agent.returncode, out, err))
    return results


def test_two_launch_agents_train_and_resume_a_heterogeneous_layout(tmp_path):
    for run in _two_agents(tmp_path, "--train.steps=2", "--run.save_every=1"):
        assert run.returncode == 0, run.stderr[-3000:]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-2"
    for run in _two_agents(tmp_path, "--train.steps=3", "--run.save_every=1", "--run.resume=auto"):
        assert run.returncode == 0, run.stderr[-3000:]
    steps = [r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert steps == [1, 2, 3]  # the second launch resumed after step 2
    assert latest_checkpoint(tmp_path) == tmp_path / "step-3"


_STUCK_RANK = """
import sys, time
import torch.distributed as dist
import loom.cli
from loom.train.trainer import Trainer
real_step = Trainer.train_step
def train_step(self, samples=None):
    if dist.get_rank() == 1 and self.step == 1:
        time.sleep(300)  # stops answering before its second step
    return real_step(self, samples)
Trainer.train_step = train_step
sys.exit(loom.cli.main(["train", *sys.argv[1:]]))
"""


def test_a_rank_that_stops_answering_ends_the_run_with_an_error_naming_it(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK_RANK)
    job = tiny_job_overrides(tmp_path / "run", "--train.steps=3", "--parallel.timeout_s=5", "--layout.world_size=2",
                             "--layout.vision.tp=1")
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(script), *job], capture_output=True, text=True, env=ENV, timeout=240)
    assert run.returncode != 0
    assert time.monotonic() - t0 < 150  # ended by the 5 s timeout, not by the stuck rank's 300 s sleep
    assert "did not complete within parallel.timeout_s = 5 s" in run.stderr, run.stderr[-3000:]
    assert "Ranks 1 failed to pass monitoredBarrier" in run.stderr, run.stderr[-3000:]
