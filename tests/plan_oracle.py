"""The list planner that train/step_parts.py replaced (loom at e531c30, train/inputs.py `split_llm`,
`split_encoder`, `balanced_runs`), kept as the oracle the array planner must equal, sample for sample; its packer is
the one data/bins.py replaced (tests/bins_oracle.py), so the whole placement is checked against the old one."""

from __future__ import annotations

from bins_oracle import assign_bins

from loom.config import JobConfig
from loom.train.length_rules import item_groups


def split_llm(tokens: list[int], rows: dict[str, list[int]], dp: int, cfg: JobConfig, indices: list[int]
              ) -> list[list[list[int]]]:
    """[microbatch][LLM replica] → global-batch positions, ascending. The items of the global batch are what is
    placed — a DPO pair's two sequences together (`item_groups`), so they share a replica and a microbatch."""
    m, budget = cfg.train.microbatches, cfg.data.tokens_per_microbatch
    groups = item_groups(indices)
    if budget:
        item_tokens = [sum(tokens[p] for p in g) for g in groups]
        item_rows = {n: [sum(r[p] for p in g) for g in groups] for n, r in rows.items()}
        bins = assign_bins(item_tokens, item_rows, dp, m, budget, [indices[g[0]] for g in groups])
        bins = [[p for item in b for p in groups[item]] for b in bins]
        return [[bins[r * m + k] for r in range(dp)] for k in range(m)]
    # equal contiguous shares (validated: the global batch divides into dp · M); after skips, nearly equal
    n = dp * m
    bounds = [j * len(groups) // n for j in range(n + 1)]
    share = [[p for g in groups[bounds[j]:bounds[j + 1]] for p in g] for j in range(n)]
    return [[share[r * m + k] for r in range(dp)] for k in range(m)]


def split_encoder(llm_parts: list[list[int]], rows: list[int], dp: int) -> list[list[int]]:
    """One microbatch's positions per encoder replica, from the LLM replicas' (see the module docstring)."""
    llm_dp = len(llm_parts)
    if dp == llm_dp:
        return llm_parts
    if dp < llm_dp:  # fan-out: an encoder replica serves k consecutive LLM replicas
        k = llm_dp // dp
        return [[p for r in range(e * k, (e + 1) * k) for p in llm_parts[r]] for e in range(dp)]
    k = dp // llm_dp  # fan-in: k encoder replicas share one LLM replica's samples, contiguously
    return [part for positions in llm_parts for part in balanced_runs(positions, rows, k)]


def balanced_runs(positions: list[int], rows: list[int], k: int) -> list[list[int]]:
    """`positions` cut into k contiguous runs of nearly equal rows (a run may be empty): each sample goes to
    the run its rows' midpoint falls in; without rows, by count."""
    total, runs, acc = sum(rows[p] for p in positions), [[] for _ in range(k)], 0
    for i, p in enumerate(positions):
        run = int(k * (acc + rows[p] / 2) / total) if total else i * k // len(positions)
        runs[min(run, k - 1)].append(p)
        acc += rows[p]
    return runs
