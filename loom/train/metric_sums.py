"""An objective's metrics kept as sums on the device over what it weighs (tokens for GRPO, pairs for DPO), their
count last: read once by the step, which adds the world's and divides (train/objective.py `metric_means`)."""

from __future__ import annotations

import torch


class MetricSums:
    metric_names: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None

    @torch.no_grad()
    def add_metrics(self, weight: torch.Tensor, values: list[torch.Tensor]) -> None:
        """Each of `values` (one per metric name) summed under `weight` (1 where it counts), then Σ weight."""
        sums = torch.stack([(v.float() * weight).sum() for v in values] + [weight.sum().float()])
        self.sums = sums if self.sums is None else self.sums + sums  # no host sync: the step reads them once

    def take_metrics(self) -> torch.Tensor | None:
        """This rank's metric sums since the last call, then none."""
        sums, self.sums = self.sums, None
        return sums
