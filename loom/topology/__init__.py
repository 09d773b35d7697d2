"""Which ranks hold which module, and which group each rank talks to — answered once, as data."""

from __future__ import annotations

from datetime import timedelta

from dataclasses import dataclass

import torch.distributed as dist

from loom.config import JobConfig
from loom.topology.checks import check_placement
from loom.topology.grid import Grid
from loom.topology.groups import GROUP_DIMS, GroupRegistry
from loom.topology.layout import DIMS, Layout, Placement, resolve_placement
from loom.topology.role import Role, StagePosition, role_of

__all__ = ["DIMS", "GROUP_DIMS", "Grid", "GroupRegistry", "Layout", "Placement", "Role", "StagePosition", "Topology"]


@dataclass
class Topology:
    placement: Placement
    grids: dict[str, Grid]
    registry: GroupRegistry | None = None

    @staticmethod
    def plan(cfg: JobConfig, world_size: int) -> Topology:
        """Layouts and grids only, no process group: for `loom plan` and for checks."""
        placement = resolve_placement(cfg, world_size)
        check_placement(placement, cfg)
        return Topology(placement, {name: Grid(lay) for name, lay in placement.layouts.items()})

    @staticmethod
    def build(cfg: JobConfig, placement: Placement | None = None) -> Topology:
        """Inside an initialised process group: every rank creates the groups of GROUP_DIMS, in the same order.
        `placement`: the job's, resolved (and checked) once at start-up; else resolved here."""
        if placement is None:
            topo = Topology.plan(cfg, dist.get_world_size())
        else:
            topo = Topology(placement, {name: Grid(lay) for name, lay in placement.layouts.items()})
        topo.registry = GroupRegistry(timeout=timedelta(seconds=cfg.parallel.timeout_s))
        topo.registry.build(list(topo.grids.values()))
        return topo

    def role(self, rank: int | None = None) -> Role:
        return role_of(dist.get_rank() if rank is None else rank, self.grids)
