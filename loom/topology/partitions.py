"""How one partition of the ranks becomes process groups, in one world-wide call, and what a rank alone gets.

A partition is a list of disjoint rank sets (e.g. every tp group of a grid). Every rank of the world makes the
same call for it, in one order, and gets back its own group (or None when it is in no set):
- NCCL whose default group is bound to a device (`init_process_group(device_id=...)`, loom/distributed.py):
  `split_group` — one `ncclCommSplit` of the world's communicator, each rank passing only its own set (torch
  reads no other set), so a rank's host work is its set's size, not the world's; communicators exist only on
  their members.
- every other backend (gloo, the fake backend of the scale simulations): `new_subgroups_by_enumeration`, one
  call naming every set; torch loops `new_group` over them, and a rank that is not a member of a set returns
  at once (no store traffic, no backend object).

A set of one rank gets no group of its own: `alone()` is a stand-in shared by every degree-1 dim — a one-rank
group of torch's fake backend, created locally (no world call, no communicator, no memory), whose collectives
raise, so a caller that forgets to skip the collective fails in tests instead of doing nothing. DTensor skips
mesh dims of size 1 and FSDP2 skips its all-gather and reduce-scatter over a one-rank shard group (torch ≥ 2.9).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

_ALONE: dict[int, dist.ProcessGroup] = {}  # rank → its stand-in (one per process; the rank never changes)


def can_split() -> bool:
    """Whether `split_group` works here: NCCL with a device bound to the default group (torch refuses others)."""
    return dist.get_backend() == "nccl" and getattr(dist.group.WORLD, "bound_device_id", None) is not None


def create_partition(sets: Callable[[], Sequence[Sequence[int]]], mine: Sequence[int] | None,
                     other: Sequence[int], backend: str | None = None, timeout: timedelta | None = None,
                     desc: str = "") -> dist.ProcessGroup | None:
    """This rank's group of the partition `sets()` (called only by the enumeration path: it is the whole world's
    list); `mine`: this rank's set, None if it is in none; `other`: any set, for a rank in none (split_group needs
    one). Every rank calls it, in one order. `backend`: other than the default's (gloo beside NCCL)."""
    if backend is None and can_split():
        return dist.split_group(split_ranks=[list(mine if mine is not None else other)], timeout=timeout,
                                group_desc=desc or None)
    group, _ = dist.new_subgroups_by_enumeration([list(s) for s in sets()], timeout=timeout, backend=backend,
                                                 group_desc=desc or None)
    return group if mine is not None else None


def alone() -> dist.ProcessGroup:
    """The stand-in group of this rank by itself (see the module's docstring); created on first use, locally."""
    rank = dist.get_rank()
    if rank not in _ALONE:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend

        options = _raising_options()
        _ALONE[rank] = dist.new_group([rank], backend="fake", pg_options=options, use_local_synchronization=True,
                                      group_desc="loom: a rank alone (degree-1 dims)")
    return _ALONE[rank]


def is_alone(group: dist.ProcessGroup | None) -> bool:
    return group is not None and group in _ALONE.values()


def release_alone() -> list[dist.ProcessGroup]:
    """At shutdown: the stand-ins, forgotten here, for topology/groups.py to destroy with the other groups."""
    out = list(_ALONE.values())
    _ALONE.clear()
    return out


def _raising_options():
    """The fake backend's options with every collective raising, where this torch has the switch."""
    from torch._C._distributed_c10d import FakeProcessGroup

    if not hasattr(FakeProcessGroup, "Options"):
        return None
    options = FakeProcessGroup.Options()
    if hasattr(options, "error_on_collective"):
        options.error_on_collective = True
    return options
