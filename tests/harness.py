"""Runs a test body on N gloo ranks on CPU, reusing spawned worlds across tests.

A world is N persistent worker processes with an initialised gloo process group; a test sends a
module-level function to all of them and gets every rank's return value back. A rank's exception is
reported with its traceback; a hang (or a dead rank) kills the world and fails the test after a timeout,
so CI never hangs.

Ranks are forked from multiprocessing's fork server, which imports torch and loom once (`PRELOAD`): a rank
started afresh spends seconds of CPU importing them (an 8-rank world tens of seconds on the 2-core CI
machine). The server holds no process group, so each forked rank starts clean. Worlds are reused as well.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable

GRACE_AFTER_FAILURE_S = 5.0  # once one rank failed, the others get this long before the world is killed
# what the ranks' test bodies import (verify, the Trainer, the digits task's sklearn), once, in the fork server
PRELOAD = ["torch", "torch.distributed", "loom.train.verify", "loom.train.trainer", "sklearn.datasets"]


class WorldError(AssertionError):
    """One or more ranks failed; the message holds each failing rank's traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, paths: list[str], tasks, results) -> None:
    sys.path[:0] = [p for p in paths if p not in sys.path]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, kwargs = item
        # a test's process groups stay: loom creates each rank set's group once per process and reuses it
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - everything is reported to the test
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()
    os._exit(0)  # skips interpreter teardown, which sometimes aborts after functional collectives


class World:
    def __init__(self, size: int) -> None:
        self.size = size
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, at the session's first world
        port = _free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(size)]
        self._procs = [
            # not daemonic: a rank may start processes of its own (the DataLoader's workers, data.workers)
            ctx.Process(target=_worker, args=(r, size, port, list(sys.path), self._tasks[r], self._results))
            for r in range(size)
        ]
        for p in self._procs:
            p.start()
        atexit.register(self.kill)  # runs before multiprocessing joins its children at exit: none is left waiting
        self.alive = True

    def run(self, fn: Callable, *args, timeout: float = 120.0, **kwargs) -> list:
        """fn(*args, **kwargs) on every rank; returns the per-rank results, rank order."""
        if not self.alive:
            raise RuntimeError("this world was killed by an earlier failure")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        done: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        while len(done) < self.size:
            if any(not ok for ok, _ in done.values()):
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
            try:
                rank, ok, value = self._results.get(timeout=0.2)
                done[rank] = (ok, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in done]
                if dead or time.monotonic() > deadline:
                    self.kill()
                    raise WorldError(self._report(done, dead, timeout))
        if any(not ok for ok, _ in done.values()):
            self.kill()  # a failed rank may have left collectives unmatched: start the next test afresh
            raise WorldError(self._report(done, [], timeout))
        return [done[r][1] for r in range(self.size)]

    def _report(self, done: dict, dead: list[int], timeout: float) -> str:
        lines = [f"{self.size}-rank world failed"]
        for r in sorted(done):
            ok, value = done[r]
            if not ok:
                lines.append(f"--- rank {r} raised:\n{value}")
        missing = [r for r in range(self.size) if r not in done]
        if dead:
            codes = [self._procs[r].exitcode for r in dead]  # -N: killed by signal N (-9 SIGKILL, -11 SIGSEGV)
            lines.append(f"--- ranks {dead} died without reporting (exit codes {codes})")
        if missing:
            lines.append(f"--- ranks {missing} did not finish within {timeout:.0f} s "
                         f"(hung or waiting on a failed rank)")
        return "\n".join(lines)

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self.alive = False

    def close(self) -> None:
        if not self.alive:
            return
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
        self.kill()


class WorldPool:
    """Keeps one live world per size, at most `max_ranks` ranks in all (least recently used closed first). A new
    world pays for its ranks' first steps (DTensor's sharding rules and the like are cached per process: seconds
    of CPU per rank), so the common sizes (2, 3, 4) stay alive beside each other; a rank holds 0.45–1 GB, and
    the CI machine has 24."""

    def __init__(self, max_ranks: int = 12) -> None:
        self.max_ranks = max_ranks
        self._worlds: dict[int, World] = {}

    def run(self, size: int, fn: Callable, *args, timeout: float = 120.0, **kwargs) -> list:
        world = self._worlds.get(size)
        if world is None or not world.alive:
            while self._worlds and sum(self._worlds) + size > self.max_ranks:
                self._worlds.pop(next(iter(self._worlds))).close()
            world = self._worlds[size] = World(size)
        else:  # most recently used last
            self._worlds[size] = self._worlds.pop(size)
        try:
            return world.run(fn, *args, timeout=timeout, **kwargs)
        finally:
            if not world.alive:
                del self._worlds[size]

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()
