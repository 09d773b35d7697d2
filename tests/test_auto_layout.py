"""`loom train --layout=auto` (loom/plan_search/auto.py): on 2 gloo ranks it picks a layout, says it beside the
runner-up, trains with it, and the layout it wrote passes `loom verify`; no layout that fits is a config error
naming the memory limit; ranks that chose differently all stop."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch.multiprocessing as mp

from loom.cli import main
from loom.exit_codes import CONFIG_ERROR
from loom.job import load_config

SMALL_JOB = ["--layout.world_size=2", "--train.steps=1", "--train.global_batch_size=8", "--data.heldout_size=8"]


def test_train_auto_picks_prints_trains_and_its_layout_verifies(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    train = subprocess.run([sys.executable, "-m", "loom", "train", "--layout=auto", *SMALL_JOB,
                            f"--run.out_dir={tmp_path}"], capture_output=True, text=True, timeout=600, env=env)
    assert train.returncode == 0, train.stderr[-3000:]
    chose = re.search(r"loom: chose +(.*): ([\d,]+) tokens/s predicted", train.stderr)
    runner_up = re.search(r"loom: runner-up +(.*): ([\d,]+) tokens/s predicted", train.stderr)
    assert chose and runner_up, train.stderr[-3000:]
    assert float(chose.group(2).replace(",", "")) >= float(runner_up.group(2).replace(",", ""))
    assert "step 1" in train.stdout and (tmp_path / "step-1").exists()
    written = tmp_path / "layout.auto.toml"
    cfg = load_config(str(written))
    assert cfg.layout.world_size == 2 and f"language tp{cfg.layout.language.tp}·cp{cfg.layout.language.cp}" in \
        chose.group(1)
    verify = subprocess.run([sys.executable, "-m", "loom", "verify", str(written), "--steps", "1"],
                            capture_output=True, text=True, timeout=600, env=env)
    assert verify.returncode == 0 and "PASS" in verify.stdout, verify.stdout[-3000:] + verify.stderr[-2000:]


def test_no_layout_that_fits_is_a_config_error_naming_the_limit(capsys, tmp_path):
    code = main(["train", "--layout=auto", "--gpu-memory", "0.001", *SMALL_JOB, f"--run.out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == CONFIG_ERROR
    assert "--layout=auto: no layout of" in err and "on 2 ranks" in err and "--gpu-memory 0.001 GiB" in err


def test_the_jobs_own_layout_does_not_stop_a_search_on_another_number_of_ranks(capsys, tmp_path):
    """default.toml's vision tp2 cannot run on 1 rank; --layout=auto replaces it, so the search runs (and here finds
    nothing under a tiny memory limit, the error naming 1 rank), not a layout error about tp2."""
    code = main(["train", "--layout=auto", "--gpus", "1", "--gpu-memory", "0.001", "--train.global_batch_size=8",
                 f"--run.out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == CONFIG_ERROR and "--layout=auto: no layout of" in err and "on 1 rank is" in err, err


def _choose(rank: int, port: int, errors) -> None:
    import torch.distributed as dist

    from loom.plan_search.auto import agree_on_choice
    from loom.typed_config import ConfigError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        agree_on_choice(["--layout.language.tp=1" if rank == 0 else "--layout.language.tp=2"], "cpu")
    except ConfigError as e:
        errors.put((rank, str(e)))
    agree_on_choice(["--layout.language.tp=2"], "cpu")  # alike: no error
    dist.destroy_process_group()


def test_ranks_that_chose_differently_all_stop():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    errors = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_choose, args=(port, errors), nprocs=2, start_method="spawn")
    found = []
    while not errors.empty():  # every rank has exited: what they raised is in the queue
        found.append(errors.get())
    found.sort()
    assert [r for r, _ in found] == [0, 1] and all("chose different layouts" in e for _, e in found)
