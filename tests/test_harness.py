"""The multi-process harness itself: results per rank, a rank's traceback, and a hang turned into a failure."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from harness import WorldError


def _rank_and_sum() -> tuple[int, int]:
    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    return dist.get_rank(), int(t)


def _fail_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")


def _hang_on_rank_0() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(0.1)


def test_results_come_back_in_rank_order(worlds):
    assert worlds.run(2, _rank_and_sum) == [(0, 3), (1, 3)]


def test_a_rank_failure_reports_its_traceback(worlds):
    with pytest.raises(WorldError) as err:
        worlds.run(2, _fail_on_rank_1)
    assert "rank 1 raised" in str(err.value) and "boom on purpose" in str(err.value)
    assert "rank 0 raised" not in str(err.value)
    assert worlds.run(2, _rank_and_sum)[0] == (0, 3)  # a fresh world replaces the failed one


def test_a_hang_becomes_a_failure(worlds):
    start = time.monotonic()
    with pytest.raises(WorldError, match=r"ranks \[0\] did not finish within 3 s"):
        worlds.run(2, _hang_on_rank_0, timeout=3)
    assert time.monotonic() - start < 20
    assert worlds.run(2, _rank_and_sum)[1] == (1, 3)
