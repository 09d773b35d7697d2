"""Planning cells: the part of a global batch a rank plans, so that its step planning does not grow with the world
(issue 50, target 4).

The global batch's items, as drawn (before bad or too-long ones are left out), are cut into cells of consecutive
items, one per group of C consecutive LLM replicas (C = data.balance_replicas; the last group takes the replicas
left), in proportion: replicas [a, b) take items ⌊n·a/dp⌋ … ⌊n·b/dp⌋ − 1. Each cell is planned as a global batch
of its own on its replicas: its bad and too-long items left out, the rest packed into its replicas' bins by the
balancing packer (with a token budget), or cut into equal contiguous shares (without one: the shares of the whole
batch, unchanged, whenever the batch divides into dp · M). At dp ≤ C there is one cell, the whole batch: the plan
of old, bit for bit. Above it, with a token budget, which replica takes which sample changes (by design); the
samples of the step, and so the one-process reference's batch, do not.

A block is what a bridge connects: one LLM replica and the encoder replicas that share its samples (fan-in, equal),
or one encoder replica and the LLM replicas whose samples it encodes (fan-out). A rank reads the runs and row
counts of its own blocks only — its LLM replica's, and each of its encoder replicas' — so it plans the cells that
hold those blocks' LLM replicas (one; a few where a fan-out block spans cells) and works out runs and counts for
the blocks alone (`windows`: ranges of LLM replicas). Its planning is its cells' and blocks', whatever the world.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Cells:
    dp: int  # the LLM's replicas
    size: int  # LLM replicas per cell (the last may hold fewer); dp: one cell

    @staticmethod
    def of(balance_replicas: int, dp: int) -> Cells:
        """data.balance_replicas over an LLM of `dp` replicas: 0, or at least dp, is the whole batch as one cell."""
        if balance_replicas < 0:
            raise ValueError(f"data.balance_replicas = {balance_replicas} must be ≥ 0 (0: the whole batch as one cell)")
        return Cells(dp, balance_replicas if 0 < balance_replicas < dp else dp)

    def __len__(self) -> int:
        return -(-self.dp // self.size)

    @property
    def single(self) -> bool:
        return len(self) == 1

    def replicas(self, c: int) -> range:
        """Cell c's LLM replicas."""
        return range(c * self.size, min((c + 1) * self.size, self.dp))

    def items(self, c: int, n: int) -> range:
        """Cell c's items of a global batch of n items, as drawn."""
        r = self.replicas(c)
        return range(n * r.start // self.dp, n * r.stop // self.dp)

    def cell_of(self, replica: int) -> int:
        return replica // self.size

    def windows(self, shares: Mapping[str, tuple]) -> list[range]:
        """The LLM replicas of this rank's blocks, merged into ascending ranges (`shares`: module → (its replica
        here or None, its dp, …)); with one cell, all of them (every replica's counts, as always)."""
        if self.single:
            return [range(self.dp)]
        mine = shares["language"][0]
        encoders = [(s[0], s[1]) for name, s in shares.items() if name != "language"]
        blocks = []
        if mine is not None:
            blocks.append((mine, mine + 1))
            blocks += [(mine // k * k, mine // k * k + k) for _, dp in encoders if (k := self.dp // dp) > 1]
        for replica, dp in encoders:
            if replica is None:
                continue
            if dp >= self.dp:  # fan-in / equal: the one LLM replica its samples come from
                blocks.append((replica // (dp // self.dp), replica // (dp // self.dp) + 1))
            else:  # fan-out: the k LLM replicas whose samples it encodes
                k = self.dp // dp
                blocks.append((replica * k, replica * k + k))
        merged: list[list[int]] = []
        for a, b in sorted(blocks):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return [range(a, b) for a, b in merged]

    def cells_of(self, windows: list[range]) -> list[int]:
        """The cells that hold the windows' replicas, ascending."""
        return sorted({c for w in windows for c in range(self.cell_of(w.start), self.cell_of(w.stop - 1) + 1)})
