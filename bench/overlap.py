"""How much two sets of GPUs worked at the same time: the overlap of a non-colocated run's encoder and LLM GPUs.

    python -m bench.overlap --group encoders=0 --group llm=1-3 OUT.timeline.rank0.json … rank3.json

Reads the per-rank timelines `bench/mm_bench.py --profile … --timeline PATH{rank}` writes (merged
compute-kernel intervals in the host's wall-clock ns, NCCL kernels left out, and each measured step's
window) and prints, per group, the share of the steps' wall time in which any of its GPUs computed, and the
share of each group's busy time during which the other group was busy too. Without overlap (one side idles
while the other works) that share is near 0; with the encoders' microbatch i + 1 under the LLM's
microbatch i it rises toward the smaller group's busy share.
"""

from __future__ import annotations

import argparse
import json

Interval = tuple[int, int]


def merge_intervals(intervals: list[Interval]) -> list[Interval]:
    """The union of `intervals` as sorted, disjoint intervals."""
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The intersection of two unions of sorted, disjoint intervals."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(intervals: list[Interval]) -> int:
    return sum(end - start for start, end in intervals)


def overlap_report(busy: dict[str, list[Interval]], windows: list[Interval]) -> dict:
    """Per group: busy share of the steps' wall time, and the share of its busy time the others were busy too."""
    window = merge_intervals(windows)
    wall = length(window)
    inside = {name: intersect(merge_intervals(b), window) for name, b in busy.items()}
    report = {"wall_s": wall / 1e9}
    for name, mine in inside.items():
        others = merge_intervals([iv for other, b in inside.items() if other != name for iv in b])
        both = length(intersect(mine, others))
        report[name] = {"busy_of_wall": round(length(mine) / max(1, wall), 4),
                        "busy_while_others_busy": round(both / max(1, length(mine)), 4)}
    return report


def parse_ranks(text: str) -> list[int]:
    """"0-2,5" → [0, 1, 2, 5]."""
    ranks = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        ranks += list(range(int(lo), int(hi or lo) + 1))
    return ranks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group", action="append", required=True, metavar="NAME=RANKS", help="e.g. encoders=0-1")
    p.add_argument("--label", default="", help="a name for the row, copied into the output")
    p.add_argument("timelines", nargs="+")
    args = p.parse_args()
    by_rank = {}
    for path in args.timelines:
        with open(path) as f:
            t = json.load(f)
        by_rank[t["rank"]] = t
    groups = dict(g.split("=", 1) for g in args.group)
    busy = {name: [tuple(iv) for r in parse_ranks(ranks) for iv in by_rank[r]["busy"]]
            for name, ranks in groups.items()}
    windows = [tuple(w) for w in by_rank[min(by_rank)]["steps"]]
    print(json.dumps({"label": args.label, "groups": groups, **overlap_report(busy, windows)}))


if __name__ == "__main__":
    main()
