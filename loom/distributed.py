"""Process-group start-up for `torchrun`: backend and device chosen from what the machine has."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from loom.rank_gpus import (check_gpu_per_local_rank, check_no_shared_gpu, gpu_of_this_rank, gpus_claimed_twice,
                             ranks_use_cuda)

BACKENDS = ("auto", "gloo", "nccl")


@contextmanager
def host_world_group() -> Iterator[dist.ProcessGroup | None]:
    """A gloo group of the whole world for host objects (all_gather_object), made for the block and destroyed
    after it: the job's groups do not exist yet, or are NCCL's. None on one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield None
        return
    group = dist.new_group(backend="gloo")
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def flight_recorder_env(trace_dir: str | os.PathLike) -> dict[str, str]:
    """NCCL's flight recorder: each rank keeps its last 2000 collectives and, when one times out, writes them
    to `trace_dir/nccl-trace-rank-R` (read them with `python -m torch.distributed.flight_recorder.fr_trace
    DIR`: which rank is behind on which collective)."""
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": os.path.join(os.fspath(trace_dir), "nccl-trace-rank-")}


def init_distributed(backend: str = "auto", timeout_s: int = 600, trace_dir: str | os.PathLike | None = None,
                     device: str = "auto") -> torch.device:
    """Initialises the default process group when launched by torchrun (WORLD_SIZE > 1) and returns this
    rank's device: NCCL + its own GPU (LOCAL_RANK: one per process on each machine) when `ranks_use_cuda`
    (train.device `device` and `backend`; 'auto' both: CUDA present), gloo + CPU otherwise. On CUDA, a rank
    without a GPU of its own raises NoGpuOfItsOwn before any process group exists. A collective that does not
    complete in `timeout_s` raises instead of hanging; on NCCL the flight recorder dumps every rank's recent
    collectives to `trace_dir` then (variables the user set win)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
    rank_device = torch.device("cpu")
    if ranks_use_cuda(backend, device):
        # from the environment alone: every rank of the machine stops, none waits in the rendezvous for the others
        check_gpu_per_local_rank(os.environ, torch.cuda.device_count(), backend, device)
        rank_device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(rank_device)
        if trace_dir is not None:  # read when the NCCL process group is created, so set before it
            os.makedirs(trace_dir, exist_ok=True)
            for key, value in flight_recorder_env(trace_dir).items():
                os.environ.setdefault(key, value)
    # DTensor warns that a norm over (dp, tp) takes two all-reduces; true, and cheap at the sizes that do it
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if launched_world_size() > 1 and not dist.is_initialized():
        join_process_group(rank_device, backend, timedelta(seconds=timeout_s))
    return rank_device


def join_process_group(rank_device: torch.device, backend: str, timeout: timedelta) -> None:
    """The default process group (NCCL on a GPU `rank_device`, else gloo) over the env:// rendezvous store —
    the one init_process_group would make itself — after checking over that store that no two ranks share a GPU."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    use_cuda = rank_device.type == "cuda"
    if use_cuda:  # NCCL refuses two ranks on one GPU; only the ranks together see it: over the store, with a timeout
        gpu = gpu_of_this_rank(rank_device.index)
        check_no_shared_gpu(gpus_claimed_twice(store, rank, world_size, gpu, timeout.total_seconds()), rank, backend)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank, world_size=world_size,
                            device_id=rank_device if use_cuda else None, timeout=timeout)


def shutdown() -> None:
    if dist.is_initialized():
        from loom.topology.groups import GroupRegistry

        GroupRegistry.destroy_all()
        dist.destroy_process_group()


class CollectiveStalled(RuntimeError):
    """A collective timed out or lost a peer: the run ends with `stalled_message` instead of hanging."""


def is_stalled_collective(error: BaseException) -> bool:
    """Whether `error` is a collective that timed out or lost its peer (gloo and NCCL word it differently)."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        s in text for s in ("Timed out", "timed out", "Connection closed by peer", "Watchdog caught collective"))


def stalled_message(error: BaseException, where: str, timeout_s: int, health_group) -> str:
    """What to tell the user when a collective stalled: on every rank the same sentence, and on rank 0 which
    ranks did not answer a monitored barrier over `health_group` (a gloo group of every rank)."""
    unanswered = ""
    if health_group is not None:
        try:
            dist.monitored_barrier(group=health_group, timeout=timedelta(seconds=min(timeout_s, 30)),
                                   wait_all_ranks=True)
        except RuntimeError as e:  # rank 0: "Ranks 1, 3 failed to pass monitoredBarrier in …"
            unanswered = f" {str(e).strip()}."
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if dist.get_backend() == "nccl" and os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT") == "1":
        prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "")
        unanswered += f" NCCL's flight recorder writes each rank's last collectives to {prefix}R."
    return (f"loom: rank {dist.get_rank()}: {where}: a collective did not complete within parallel.timeout_s = "
            f"{timeout_s} s: a rank stopped or is stuck.{unanswered} ({first_line})")
