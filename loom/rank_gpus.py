"""One GPU per rank: whether launched ranks run on CUDA, the start-up checks that each rank has a GPU of its own
(NCCL refuses two ranks on one GPU, and a LOCAL_RANK past the GPU count is "invalid device ordinal"), and the
local launcher's choice of CPU ranks when the machine has GPUs, but fewer than the job's ranks.

The per-machine check reads torchrun's environment alone, so every rank of a machine decides the same without
communicating; the shared-GPU check claims each rank's GPU in the rendezvous store, with a timeout, before NCCL
starts. Either raises `NoGpuOfItsOwn` (exit code 2), which one rank prints."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from datetime import timedelta

import torch

from loom.typed_config import ConfigError

GPU_KEY = "loom/gpu-of-rank"  # rendezvous store keys: f"{GPU_KEY}/{restart}/{rank}"
CPU_RANKS_OVERRIDE = "--train.device=cpu"  # what the local launcher adds to run the ranks on CPU


class NoGpuOfItsOwn(ConfigError):
    """A launch whose ranks cannot each have a GPU. `speaks`: this rank prints the message (one per machine, or
    rank 0); the others wait `wait_s` at most, so it is printed before torchrun stops them, and exit alike."""

    def __init__(self, message: str, speaks: bool, wait_s: float) -> None:
        super().__init__(message)
        self.speaks = speaks
        self.wait_s = wait_s


def ranks_use_cuda(backend: str, device: str) -> bool:
    """Whether launched ranks run on their GPUs with NCCL: when parallel.backend = 'nccl' or train.device = 'cuda'
    asks for it, or both are 'auto' and CUDA is present (check_combinations refuses cpu + nccl, cuda + gloo)."""
    if backend == "auto" and device == "auto":
        return torch.cuda.is_available()
    return backend == "nccl" or device == "cuda"


def why_cuda(backend: str, device: str) -> str:
    """The key that put the ranks on GPUs, for the messages."""
    if backend == "nccl":
        return "parallel.backend = 'nccl'"
    return "train.device = 'cuda'" if device == "cuda" else "train.device = 'auto' with CUDA present"


def cpu_fix(backend: str) -> str:
    """The overrides that run every rank on CPU with gloo (train.device = 'cpu' refuses parallel.backend = 'nccl')."""
    return "--train.device=cpu" + (" --parallel.backend=gloo" if backend == "nccl" else "")


def local_ranks_needing_gpus(env: Mapping[str, str]) -> int:
    """GPUs this machine's ranks need, as far as this rank can tell: LOCAL_WORLD_SIZE (torchrun gives every rank
    the same, so they all decide alike), or more when this rank's LOCAL_RANK lies beyond it (another launcher)."""
    return max(int(env.get("LOCAL_WORLD_SIZE", "0")), int(env.get("LOCAL_RANK", "0")) + 1)


def check_gpu_per_local_rank(env: Mapping[str, str], gpus_visible: int, backend: str, device: str) -> None:
    """More ranks on this machine than GPUs: every one of its ranks raises NoGpuOfItsOwn (LOCAL_RANK 0 prints it),
    the ranks in range too, so none waits for the others in the rendezvous."""
    needed = local_ranks_needing_gpus(env)
    if needed <= gpus_visible:
        return
    local_rank, local_world = int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", "0"))
    # a rank LOCAL_WORLD_SIZE does not count is the only one that knows: it speaks for itself
    speaks = local_rank == 0 or local_rank >= local_world
    raise NoGpuOfItsOwn(too_few_gpus_message(env, needed, gpus_visible, backend, device), speaks, wait_s=30.0)


def too_few_gpus_message(env: Mapping[str, str], needed: int, gpus_visible: int, backend: str, device: str) -> str:
    """What a machine with fewer GPUs than ranks is told: the numbers, the key that asked for GPUs, the fixes."""
    ranks = (f"{env['LOCAL_WORLD_SIZE']} ranks on this machine (LOCAL_WORLD_SIZE)" if "LOCAL_WORLD_SIZE" in env
             else f"LOCAL_RANK {needed - 1} on this machine (LOCAL_WORLD_SIZE not set)")
    shown = f", CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}" if "CUDA_VISIBLE_DEVICES" in env else ""
    without = f"{gpus_visible}" if needed - gpus_visible == 1 else f"{gpus_visible}–{needed - 1}"
    fixes = (f"torchrun --nproc-per-node={gpus_visible} (one rank per GPU) with a config whose layout.world_size "
             f"matches, or " if gpus_visible else "")
    return (f"{ranks} but {gpus_visible} GPU{'' if gpus_visible == 1 else 's'} visible (torch.cuda.device_count()"
            f"{shown}): LOCAL_RANK {without} would have no GPU of its own, and NCCL ({why_cuda(backend, device)}) "
            f"needs one per rank. Fix: {fixes}{cpu_fix(backend)} to run every rank on CPU with gloo")


def gpu_of_this_rank(local_rank: int) -> dict[str, str | int]:
    """What names this rank's GPU across machines: the device's UUID, and for the message its host and LOCAL_RANK."""
    uuid = str(torch.cuda.get_device_properties(local_rank).uuid)
    return {"uuid": uuid, "host": socket.gethostname(), "local_rank": local_rank}


def gpus_claimed_twice(store, rank: int, world_size: int, gpu: Mapping[str, str | int], timeout_s: float
                       ) -> list[list[dict]]:
    """The ranks that found their GPU already claimed, as [holder, claimer] pairs (empty: a GPU per rank), the
    same on every rank. Each rank claims its GPU's UUID in the rendezvous store (compare_set: the first claim
    wins) and counts itself in; a few store operations per rank, not a gather of every rank's GPU (thousands of
    ranks start through one store). A rank that never arrives ends the wait after `timeout_s` (DistStoreError)."""
    prefix = f"{GPU_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # a restarted job's keys are fresh
    mine = json.dumps({**gpu, "rank": rank})
    holder = store.compare_set(f"{prefix}/uuid/{gpu['uuid']}", "", mine)
    if holder != mine.encode():  # recorded before this rank counts itself in: complete once all have arrived
        index = store.add(f"{prefix}/claimed-twice", 1) - 1
        store.set(f"{prefix}/claimed-twice/{index}", json.dumps([json.loads(holder), json.loads(mine)]))
    if store.add(f"{prefix}/arrived", 1) == world_size:
        store.set(f"{prefix}/all-arrived", "1")
    store.wait([f"{prefix}/all-arrived"], timedelta(seconds=timeout_s))
    count = store.add(f"{prefix}/claimed-twice", 0)
    return [json.loads(store.get(f"{prefix}/claimed-twice/{i}")) for i in range(count)]


def ranks_sharing_a_gpu(pairs: list[list[Mapping]]) -> list[list[dict]]:
    """The [holder, claimer] pairs grouped by GPU: each group's ranks' GPU records, in rank order."""
    by_uuid: dict[str, dict[int, dict]] = {}
    for pair in pairs:
        for gpu in pair:
            by_uuid.setdefault(str(gpu["uuid"]), {})[int(gpu["rank"])] = dict(gpu)
    return [[ranks[r] for r in sorted(ranks)] for ranks in by_uuid.values()]


def check_no_shared_gpu(pairs: list[list[Mapping]], rank: int, backend: str) -> None:
    """Two ranks on one GPU: every rank, having read the same pairs, raises NoGpuOfItsOwn; rank 0 prints it."""
    if pairs:
        # every rank met at the store just before, so rank 0 is moments from printing
        raise NoGpuOfItsOwn(shared_gpu_message(ranks_sharing_a_gpu(pairs), backend), speaks=rank == 0, wait_s=5.0)


def shared_gpu_message(groups: list[list[Mapping]], backend: str) -> str:
    """What ranks that share a GPU are told: which ranks, on which host and LOCAL_RANK, and the fixes."""
    said = "; ".join(
        f"ranks {', '.join(str(g['rank']) for g in gpus)} on {gpus[0]['host']} (LOCAL_RANK "
        f"{', '.join(str(g['local_rank']) for g in gpus)}) share GPU {gpus[0]['uuid']}"
        for gpus in groups)
    return (f"{said}: NCCL needs a GPU per rank, and a rank's GPU is its LOCAL_RANK among the GPUs it sees. "
            f"Fix: one torchrun per machine with --nproc-per-node at most its GPU count (it numbers LOCAL_RANK "
            f"0…n-1), or {cpu_fix(backend)} to run every rank on CPU with gloo")


def cpu_ranks_note(n_ranks: int, gpus_visible: int, backend: str, device: str, command: str) -> str | None:
    """The local launcher's one line when it runs the job's N ranks on CPU: only when nothing asked for GPUs and
    the machine has some, but fewer than N (none: the ranks are on CPU anyway; N or more: one each). None else."""
    if backend != "auto" or device != "auto" or not 0 < gpus_visible < n_ranks:
        return None
    gpus = f"{gpus_visible} GPU{'' if gpus_visible == 1 else 's'}"
    return (f"loom: {n_ranks} ranks (layout.world_size) but {gpus} visible: running the {n_ranks} ranks on CPU "
            f"with gloo ({CPU_RANKS_OVERRIDE}). To use the {gpus}: a config with layout.world_size = {gpus_visible} "
            f"and layouts that fit it (loom starts a rank per GPU), or torchrun --nproc-per-node={gpus_visible} -m "
            f"loom {command} CONFIG with such a config")
