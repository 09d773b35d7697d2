"""Which rows of which encoder replica go to which LLM ranks: the routing both first-stage bridges share
(the colocated three-phase one, bridge/first_stage.py, and the point-to-point one, bridge/p2p.py).

An encoder replica's rows are replicated over its tp ranks; the LLM replica that owns their samples inserts
them on every one of its stage-0 ranks (all cp and tp ranks). Which encoder replica holds which LLM
replica's samples is the fan-in / fan-out / equal assignment of train/step_parts.py `split_encoder_parts`,
microbatch after microbatch; row counts come from host data, so every rank derives every chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.bridge.known_rows import known_runs
from loom.bridge.replica_rows import ReplicaRows
from loom.topology.grid import Grid


@dataclass(frozen=True)
class Chunk:
    """Rows [src, src + n) of encoder replica `encoder` are rows [dst, dst + n) of LLM replica `llm`."""

    encoder: int
    src: int
    llm: int
    dst: int
    n: int


def step_chunks(counts: list[ReplicaRows]) -> list[Chunk]:
    """Every chunk of one step the counts hold; `counts`: each microbatch's rows per replica on both sides. A step
    planned in cells (train/plan_cells.py) holds only the blocks of this rank's replicas: their chunks, the only
    ones this rank sends or receives."""
    enc_dp, llm_dp = len(counts[0].encoder), len(counts[0].llm)
    encoders = [e for run in known_runs(counts[0].encoder) for e in run]  # whole blocks, ascending
    if enc_dp >= llm_dp:  # fan-in / equal: k encoder replicas share one LLM replica's samples, in order
        k = enc_dp // llm_dp
        llms = sorted({e // k for e in encoders})
    else:  # fan-out: one encoder replica holds k LLM replicas' samples, one after another
        k = llm_dp // enc_dp
        llms = [d for e in encoders for d in range(e * k, (e + 1) * k)]
    enc_done, llm_done = [0] * enc_dp, [0] * llm_dp  # rows of earlier microbatches
    chunks = []
    for rows in counts:
        if enc_dp >= llm_dp:
            for e in encoders:
                d = e // k
                before = sum(rows.encoder[d * k : e])
                chunks.append(Chunk(e, enc_done[e], d, llm_done[d] + before, rows.encoder[e]))
        else:
            for d in llms:
                e = d // k
                before = sum(rows.llm[e * k : d])
                chunks.append(Chunk(e, enc_done[e] + before, d, llm_done[d], rows.llm[d]))
        for e in encoders:
            enc_done[e] += rows.encoder[e]
        for d in llms:
            llm_done[d] += rows.llm[d]
    return [c for c in chunks if c.n]


def producers(src: Grid) -> list[list[int]]:
    """Encoder replica e → the ranks that hold its rows: its last pipeline stage's (the projector's), over
    which they are replicated (tp)."""
    return src.ranks[src.layout.pp - 1, :, 0, :].tolist()  # [dp, tp] in one tolist: dp lookups were O(dp) µs


def consumers(dst: Grid) -> list[list[int]]:
    """LLM replica d → its stage-0 ranks, cp-major: the first one holds the cp-summed row gradients."""
    return dst.ranks[0].reshape(dst.layout.dp, -1).tolist()  # [dp, cp·tp], tp fastest, in one tolist
