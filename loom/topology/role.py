"""What one rank hosts: which modules, and for each its pipeline stage.

Non-colocated ranks build only the modules they host; a pipelined module builds only its stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.topology.grid import Grid


@dataclass(frozen=True)
class StagePosition:
    """Where a rank sits in one module's pipeline: stage `index` of `count`."""

    index: int
    count: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1


@dataclass(frozen=True)
class Role:
    rank: int
    stages: dict[str, StagePosition]  # hosted module → its pipeline stage on this rank

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(self.stages)

    def hosts(self, module: str) -> bool:
        return module in self.stages

    def stage(self, module: str) -> StagePosition:
        if module not in self.stages:
            raise KeyError(f"rank {self.rank} does not host {module!r}; it hosts {list(self.stages)}")
        return self.stages[module]


def role_of(rank: int, grids: dict[str, Grid]) -> Role:
    stages = {name: StagePosition(grid.coord(rank)["pp"], grid.layout.pp)
              for name, grid in grids.items() if grid.contains(rank)}
    if not stages:
        raise RuntimeError(f"rank {rank} belongs to no module's grid; the layouts must tile the world")
    return Role(rank, stages)
