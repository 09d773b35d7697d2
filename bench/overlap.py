"""How much two sets of GPUs worked at the same time: the overlap of a non-colocated run's encoder and LLM GPUs.

    python -m bench.overlap --group encoders=0 --group llm=1-3 OUT.timeline.rank0.json … rank3.json

Reads the per-rank timelines `bench/mm_bench.py --profile … --timeline PATH{rank}` writes (merged
compute-kernel intervals in the host's wall-clock ns, NCCL kernels left out, and each measured step's
window) and prints, per group, the share of the steps' wall time in which any of its GPUs computed, and the
share of each group's busy time during which the other group was busy too. Without overlap (one side idles
while the other works) that share is near 0; with the encoders' microbatch i + 1 under the LLM's
microbatch i it rises toward the smaller group's busy share.

exposed_comm and comm_summary give the share of a step in which only communication ran and the ranks' compute
skew, which bench/profiling.py's comm_report puts in the benchmarks' JSON line.
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


def exposed_comm(compute: list[Interval], comm: list[Interval], windows: list[Interval]) -> tuple[float, float]:
    """One rank over its measured steps: (the share of the steps' wall time in which a communication kernel ran
    and no compute kernel did, compute-busy time per step in the intervals' unit). A collective under compute is
    hidden; one alone holds the step up (or waits for a peer, which holds it up as much)."""
    window = merge_intervals(windows)
    comm_in = intersect(merge_intervals(comm), window)
    compute_in = intersect(merge_intervals(compute), window)
    exposed = length(comm_in) - length(intersect(comm_in, compute_in))
    return exposed / max(1, length(window)), length(compute_in) / max(1, len(windows))


def rank_skew(compute: list[float]) -> float | None:
    """The largest distance of a rank's compute time from the ranks' mean, as a share of the mean: 0 when every
    rank computes as long; the slowest rank sets the step and the others wait in the next collective."""
    mean = sum(compute) / len(compute) if compute else 0
    return max(abs(c - mean) for c in compute) / mean if mean > 0 else None


def comm_summary(per_rank: list[tuple[float, float] | None]) -> dict:
    """The benchmark's JSON keys from each rank's (exposed share, compute s per step); None for a rank with no
    device kernels (CPU) makes every key null."""
    if not per_rank or any(r is None for r in per_rank):
        return {"exposed_comm_share": None, "exposed_comm_share_per_rank": None, "compute_s_per_step": None,
                "rank_skew": None}
    shares, compute = [r[0] for r in per_rank], [r[1] for r in per_rank]
    skew = rank_skew(compute)
    return {"exposed_comm_share": round(sum(shares) / len(shares), 4),
            "exposed_comm_share_per_rank": [round(x, 4) for x in shares],
            "compute_s_per_step": [round(c, 5) for c in compute], "rank_skew": None if skew is None else round(skew, 4)}


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
