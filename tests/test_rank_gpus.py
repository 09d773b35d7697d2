"""One GPU per rank (issue 36), with the GPU count faked (no GPU here): the local launcher runs the job's ranks
on CPU when the machine has GPUs but fewer than the ranks; any launch with more ranks on a machine than GPUs, or
two ranks on one GPU, stops before a model is built with one config error (exit 2) and no rank left waiting."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import loom.cli
import loom.distributed
from loom.config import ConfigError
from loom.job import load_config
from loom.rank_gpus import (NoGpuOfItsOwn, check_gpu_per_local_rank, check_no_shared_gpu, cpu_ranks_note,
                            gpus_claimed_twice, ranks_sharing_a_gpu, ranks_use_cuda)

TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")


def _has_all(msg: str, *parts: str) -> None:
    missing = [p for p in parts if p not in msg]
    assert not missing, f"{missing} not in message: {msg}"


@pytest.fixture
def gpus(monkeypatch):
    """`gpus(n)`: this process sees n GPUs (CUDA present when n > 0), and no torchrun variable is set."""
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)

    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    return fake


# ---------------------------------------------------------------- the device the ranks run on


@pytest.mark.parametrize("backend, device, cuda_present, expected", [
    ("auto", "auto", True, True), ("auto", "auto", False, False), ("auto", "cpu", True, False),
    ("gloo", "auto", True, False), ("nccl", "auto", False, True), ("auto", "cuda", False, True),
])
def test_ranks_use_cuda_when_a_key_asks_or_both_are_auto_and_cuda_is_present(gpus, backend, device, cuda_present,
                                                                              expected):
    gpus(2 if cuda_present else 0)
    assert ranks_use_cuda(backend, device) is expected


@pytest.mark.parametrize("device, backend", [("cpu", "nccl"), ("cuda", "gloo")])
def test_a_device_and_backend_that_disagree_are_a_config_error(device, backend):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"--train.device={device}", f"--parallel.backend={backend}"])
    _has_all(str(e.value), f"train.device = '{device}'", f"parallel.backend = '{backend}'", "'auto'")


def test_train_device_cpu_keeps_a_launched_rank_off_its_gpu(gpus, monkeypatch):
    gpus(4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"set_device({d}) with train.device = cpu"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert loom.distributed.init_distributed("auto", device="cpu") == torch.device("cpu")


# ---------------------------------------------------------------- the local launcher's choice


@pytest.mark.parametrize("n_gpus, backend, device", [(0, "auto", "auto"), (4, "auto", "auto"), (8, "auto", "auto"),
                                                     (1, "nccl", "auto"), (1, "auto", "cuda")])
def test_the_launcher_keeps_the_ranks_where_they_were_asked_or_fit(n_gpus, backend, device):
    assert cpu_ranks_note(4, n_gpus, backend, device, "train") is None


def test_the_launcher_runs_ranks_on_cpu_when_gpus_are_fewer_and_says_how_to_use_them():
    note = cpu_ranks_note(4, 1, "auto", "auto", "train")
    _has_all(note, "4 ranks (layout.world_size) but 1 GPU visible", "on CPU", "--train.device=cpu",
             "layout.world_size = 1", "torchrun --nproc-per-node=1 -m loom train CONFIG")
    assert "\n" not in note
    _has_all(cpu_ranks_note(4, 2, "auto", "auto", "verify"), "2 GPUs visible", "--nproc-per-node=2 -m loom verify")


def _launch_default_job(monkeypatch, *argv: str) -> dict:
    """`loom train ARGV` with no launcher: what it would start the ranks with and evaluate on afterwards."""
    seen: dict = {}
    monkeypatch.setattr(loom.cli, "launch_local", lambda n, args: seen.update(n=n, args=args) or 0)
    monkeypatch.setattr(loom.cli, "_eval", lambda out, device: seen.update(eval_device=device) or 0)
    assert loom.cli.main(["train", *argv]) == 0
    return seen


def test_loom_train_on_a_one_gpu_machine_runs_the_default_job_on_cpu(gpus, monkeypatch, capsys):
    gpus(1)
    seen = _launch_default_job(monkeypatch, "--train.steps=20")
    assert seen["n"] == 4 and seen["args"][-2:] == ["--train.steps=20", "--train.device=cpu"]
    assert seen["eval_device"] == "cpu"  # the checkpoint's generation after training, too
    _has_all(capsys.readouterr().err, "1 GPU visible: running the 4 ranks on CPU")


def test_loom_train_with_a_gpu_per_rank_or_cuda_asked_changes_nothing(gpus, monkeypatch, capsys):
    gpus(4)
    assert "--train.device=cpu" not in _launch_default_job(monkeypatch)["args"]
    gpus(1)
    seen = _launch_default_job(monkeypatch, "--train.device=cuda")  # the ranks' start-up check says why
    assert "--train.device=cpu" not in seen["args"] and seen["eval_device"] == "cuda"
    assert "on CPU" not in capsys.readouterr().err


# ---------------------------------------------------------------- more ranks on a machine than GPUs


@pytest.mark.parametrize("local_rank", [0, 1, 2, 3])
def test_every_rank_of_a_machine_with_fewer_gpus_stops_and_local_rank_0_speaks(local_rank):
    env = {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": str(local_rank), "CUDA_VISIBLE_DEVICES": "0"}
    with pytest.raises(NoGpuOfItsOwn) as e:
        check_gpu_per_local_rank(env, 1, "auto", "auto")
    assert e.value.speaks is (local_rank == 0)
    _has_all(str(e.value), "4 ranks on this machine (LOCAL_WORLD_SIZE)", "1 GPU visible", "CUDA_VISIBLE_DEVICES=0",
             "LOCAL_RANK 1–3 would have no GPU", "train.device = 'auto' with CUDA present",
             "torchrun --nproc-per-node=1", "--train.device=cpu")


def test_a_gpu_per_local_rank_passes():
    for local_rank in range(4):
        check_gpu_per_local_rank({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": str(local_rank)}, 4, "auto", "auto")


def test_a_launcher_without_local_world_size_stops_the_ranks_past_the_gpus():
    check_gpu_per_local_rank({"LOCAL_RANK": "1"}, 2, "auto", "auto")
    with pytest.raises(NoGpuOfItsOwn) as e:
        check_gpu_per_local_rank({"LOCAL_RANK": "2"}, 2, "auto", "auto")
    assert e.value.speaks  # the only rank that knows
    _has_all(str(e.value), "LOCAL_RANK 2 on this machine (LOCAL_WORLD_SIZE not set)", "LOCAL_RANK 2 would have")


def test_nccl_on_a_machine_without_gpus_names_the_key_and_the_cpu_fix():
    with pytest.raises(NoGpuOfItsOwn) as e:
        check_gpu_per_local_rank({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}, 0, "nccl", "auto")
    _has_all(str(e.value), "0 GPUs visible", "parallel.backend = 'nccl'", "--train.device=cpu --parallel.backend=gloo")
    assert "--nproc-per-node" not in str(e.value)


def _launched_rank(monkeypatch, local_rank: int, local_world_size: int = 2) -> None:
    for var, value in {"WORLD_SIZE": local_world_size, "RANK": local_rank, "LOCAL_RANK": local_rank,
                       "LOCAL_WORLD_SIZE": local_world_size}.items():
        monkeypatch.setenv(var, str(value))
    monkeypatch.setattr(dist, "rendezvous", lambda *a, **k: pytest.fail("went to the rendezvous"))
    import loom.train.trainer

    monkeypatch.setattr(loom.train.trainer, "Trainer", lambda *a, **k: pytest.fail("built a Trainer"))


def test_a_launched_rank_without_a_gpu_stops_before_the_model_with_a_config_error(gpus, monkeypatch, capsys):
    gpus(1)
    _launched_rank(monkeypatch, local_rank=0)
    assert loom.cli.main(["train", "configs/tiny.toml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loom: config error: 2 ranks on this machine") and err.count("\n") == 1, err


def test_the_other_ranks_stop_too_without_a_word(gpus, monkeypatch, capsys):
    gpus(1)
    _launched_rank(monkeypatch, local_rank=1)
    waited = []
    monkeypatch.setattr(loom.cli.time, "sleep", waited.append)
    assert loom.cli.main(["train", "configs/tiny.toml"]) == 2
    assert capsys.readouterr().err == "" and waited == [30.0]  # until torchrun stops it, once rank 0 has spoken


# ---------------------------------------------------------------- two ranks on one GPU


def _gpu(uuid: str, local_rank: int = 0, host: str = "node0", rank: int | None = None) -> dict:
    gpu = {"uuid": uuid, "host": host, "local_rank": local_rank}
    return gpu if rank is None else {**gpu, "rank": rank}


def test_ranks_sharing_a_gpu_are_grouped_by_its_uuid():
    pairs = [[_gpu("A", 0, rank=0), _gpu("A", 0, rank=2)], [_gpu("B", 1, rank=1), _gpu("B", 1, rank=3)],
             [_gpu("A", 0, rank=0), _gpu("A", 0, rank=4)]]
    assert [[g["rank"] for g in group] for group in ranks_sharing_a_gpu(pairs)] == [[0, 2, 4], [1, 3]]


@pytest.mark.parametrize("rank", [0, 1])
def test_two_ranks_on_one_gpu_stop_alike_and_rank_0_speaks(rank):
    with pytest.raises(NoGpuOfItsOwn) as e:
        check_no_shared_gpu([[_gpu("GPU-7", 0, rank=0), _gpu("GPU-7", 0, rank=1)]], rank, "auto")
    assert e.value.speaks is (rank == 0)
    _has_all(str(e.value), "ranks 0, 1 on node0 (LOCAL_RANK 0, 0) share GPU GPU-7", "--nproc-per-node",
             "--train.device=cpu")
    check_no_shared_gpu([], rank, "auto")  # a GPU each: nothing raised


def _claim_on_threads(uuids: list[str]) -> dict[int, list]:
    """Every rank (a thread each, ranks started in reverse) claims its GPU in one HashStore."""
    store, got = dist.HashStore(), {}

    def claim(rank: int) -> None:
        got[rank] = gpus_claimed_twice(store, rank, len(uuids), _gpu(uuids[rank], rank), timeout_s=10)

    threads = [threading.Thread(target=claim, args=(r,)) for r in reversed(range(len(uuids)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def test_every_rank_reads_the_same_gpus_claimed_twice_over_the_store():
    got = _claim_on_threads(["U0", "U1", "U0", "U2", "U0"])
    assert got[0] == got[1] == got[2] == got[3] == got[4] and len(got[0]) == 2  # ranks 0, 2, 4 on U0
    assert [[g["rank"] for g in group] for group in ranks_sharing_a_gpu(got[0])] == [[0, 2, 4]]
    assert all(g == [] for g in _claim_on_threads(["U0", "U1", "U2"]).values())  # a GPU each


def test_the_claim_ends_when_a_rank_never_arrives():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):  # DistStoreError: the missing rank never counted itself in
        gpus_claimed_twice(dist.HashStore(), 0, 2, _gpu("U0"), timeout_s=0.5)
    assert time.monotonic() - t0 < 5


# ---------------------------------------------------------------- end to end: ranks under loom.launch

_FAKE_GPUS = """
import sys, torch
import loom.distributed
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: {gpus}
torch.cuda.set_device = lambda device: None
loom.distributed.gpu_of_this_rank = lambda i: {{"uuid": "GPU-0", "host": "node0", "local_rank": i}}  # all: one GPU
import loom.cli
sys.exit(loom.cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("n_gpus, says", [(1, "2 ranks on this machine (LOCAL_WORLD_SIZE) but 1 GPU visible"),
                                          (2, "ranks 0, 1 on node0 (LOCAL_RANK 0, 1) share GPU GPU-0")])
def test_two_ranks_under_the_local_launcher_end_with_one_message_and_code_2(tmp_path, n_gpus, says):
    script = tmp_path / "fake_gpus.py"
    script.write_text(_FAKE_GPUS.format(gpus=n_gpus))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    # the timeout guards against a rank left waiting; rank 1 is stopped once rank 0 exits, or after its own wait
    run = subprocess.run([sys.executable, "-m", "loom.launch", "--standalone", "--nproc-per-node=2", str(script),
                          "train", "configs/tiny.toml", f"--run.out_dir={tmp_path}"],
                         capture_output=True, text=True, env=env, timeout=180)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.count("loom: config error:") == 1 and says in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "ChildFailedError" not in run.stderr
