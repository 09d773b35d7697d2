"""`loom plan`: the rank map of a job as a table and as a picture, without starting any process."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from loom.topology import Topology


def rank_map_table(topo: Topology) -> Table:
    p = topo.placement
    table = Table(title=f"{p.world_size} ranks, {p.kind}")
    table.add_column("rank", justify="right")
    for name, lay in p.layouts.items():
        table.add_column(f"{name}\n{lay.describe().split(' on ')[0]}")
    for rank in range(p.world_size):
        cells = []
        for name, grid in topo.grids.items():
            if not grid.contains(rank):
                cells.append("·")
                continue
            c = grid.coord(rank)
            stage = f" stage {c['pp']}/{grid.layout.pp}" if grid.layout.pp > 1 else ""
            # expert parallel: ep consecutive ranks of dp×cp hold one copy of all experts (parallel/experts.py)
            lay = grid.layout
            ep = f" ep{(c['dp'] * lay.cp + c['cp']) % lay.ep}" if lay.ep > 1 else ""
            cells.append(f"dp{c['dp']} tp{c['tp']} cp{c['cp']}{ep}{stage}")
        table.add_row(str(rank), *cells)
    return table


def bridge_lines(topo: Topology) -> list[str]:
    """Colocated: which ranks each encoder replica's rows feed — the LLM replica's stage-0 ranks (all of its
    ranks without pp), by the fan-in / fan-out assignment of train/inputs.py."""
    if not topo.placement.colocated:
        return []
    lang = topo.grids["language"]
    ld = lang.layout
    first_stage = lambda d: [lang.rank_at(pp=0, dp=d, cp=c, tp=t) for c in range(ld.cp) for t in range(ld.tp)]  # noqa: E731
    lines = []
    for name, grid in topo.grids.items():
        if name == "language":
            continue
        ed = grid.layout.dp
        for e in range(ed):
            ranks = [grid.rank_at(pp=0, dp=e, cp=0, tp=t) for t in range(grid.layout.tp)]
            fed = [e * ld.dp // ed] if ed >= ld.dp else list(range(e * ld.dp // ed, (e + 1) * ld.dp // ed))
            stage = " stage 0" if ld.pp > 1 else ""
            where = "; ".join(f"LLM replica {d}{stage} on ranks {first_stage(d)}" for d in fed)
            lines.append(f"{name} replica {e} (ranks {ranks}) → {where}")
    return lines


def print_plan(topo: Topology, console: Console | None = None) -> None:
    console = console or Console()
    console.print(rank_map_table(topo))
    for line in bridge_lines(topo):
        console.print(line)


def draw_plan(topo: Topology, path: str | Path) -> Path:
    """PNG: ranks as columns, modules as rows, one colour per dp replica, tp/cp/pp written in each cell."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    p = topo.placement
    names = list(topo.grids)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.15 * p.world_size + 1.5), 0.9 * len(names) + 1.4))
    cmap = plt.get_cmap("tab20")
    for row, name in enumerate(names):
        grid = topo.grids[name]
        for rank in range(p.world_size):
            y = len(names) - 1 - row
            if not grid.contains(rank):
                ax.add_patch(plt.Rectangle((rank, y), 1, 1, facecolor="#eeeeee", edgecolor="white", lw=2))
                continue
            c = grid.coord(rank)
            ax.add_patch(plt.Rectangle((rank, y), 1, 1, facecolor=cmap(c["dp"] % 20), edgecolor="white", lw=2))
            text = f"dp{c['dp']}\ntp{c['tp']} cp{c['cp']}"
            if grid.layout.pp > 1:
                text += f"\npp{c['pp']}"
            ax.text(rank + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, p.world_size)
    ax.set_ylim(0, len(names))
    ax.set_xticks([r + 0.5 for r in range(p.world_size)], [str(r) for r in range(p.world_size)])
    ax.set_yticks([len(names) - 0.5 - i for i in range(len(names))], names)
    ax.set_xlabel("global rank")
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(f"{p.kind}: " + ";  ".join(f"{n} {topo.grids[n].layout.describe().split(' on ')[0]}" for n in names),
                 fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
