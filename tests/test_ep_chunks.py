"""Expert parallelism's exchange in chunks (`parallel.ep_chunks`, parallel/expert_chunks.py): the same outputs and
gradients as one exchange, and the all-to-alls in flight while the experts compute, forward and backward — the
host's order of issues and waits, which on CUDA becomes the streams' overlap (the device timeline itself needs a
GPU: bench/README.md). Whole-model parity with chunks: tests/test_moe_parity.py; compiled: tests/test_compiled_ep.py
and tests/test_ep_recompiles.py."""

from __future__ import annotations

import pytest


def _chunked_block_timeline(chunks: int, skewed: bool) -> dict:
    """On each of 2 ranks: one MoE block with its experts split over ep 2, exchanged in one piece and in `chunks`;
    the largest differences of output and gradients between the two, and the chunked run's timeline: every
    all-to-all started and waited (`start d0`, `wait c1`: dispatch / combine of a chunk, `rd0`, `rc1` their reverse
    in backward) and every chunk's experts called forward (`experts 0`) and about to differentiate (`experts' 0`)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    import loom.parallel.expert_chunks as ec
    from loom.models.moe import MoEBlock
    from loom.models.router import RouterSpec
    from loom.parallel.experts import ExpertParallel

    mesh = init_device_mesh("cpu", (2,))
    blocks = []
    for c in (1, chunks):
        torch.manual_seed(0)
        b = MoEBlock(16, RouterSpec(8, 2, "sigmoid", choice_bias=True), 8)
        with torch.no_grad():
            for p in b.parameters():
                p.normal_(0, 0.3)
            if skewed:  # every token to experts 0 and 1: rank 1 receives nothing in any chunk
                b.gate.e_score_correction_bias.copy_(torch.tensor([50.0, 50.0] + [0.0] * 6))
        parallelize_module(b.experts, mesh, ExpertParallel(c))
        blocks.append(b)

    events: list[str] = []
    names: dict[int, str] = {}  # a flight's name by id, given when it first starts
    plan, start, finish, combine = ec._plan, ec._InFlight.start, ec._InFlight.finish, ec._combine
    started = {"d": 0, "c": 0}

    def named_start(self, x, recv, send, group):
        if id(self) not in names:  # forward: dispatches and combines by chunk, in issue order
            kind = "c" if getattr(x, "_combined", False) else "d"
            names[id(self)] = f"{kind}{started[kind]}"
            started[kind] += 1
        elif not names[id(self)].startswith("r"):
            names[id(self)] = "r" + names[id(self)]  # backward: the reverse of the same exchange
        events.append(f"start {names[id(self)]}")
        start(self, x, recv, send, group)

    def named_finish(self):
        events.append(f"wait {names[id(self)]}")
        return finish(self)

    def marked_compute(*args):
        chunk = sum(e.startswith("experts ") for e in events)
        events.append(f"experts {chunk}")
        y = compute(*args)
        y.register_hook(lambda g: events.append(f"experts' {chunk}"))  # the chunk's experts differentiate next
        return y

    def marked_combine(y, recv, send, group):
        piece = y.narrow(0, 0, sum(recv))
        piece._combined = True
        return ec._dispatch(piece, send, recv, group)

    results = []
    for b in blocks:
        torch.manual_seed(1 + dist.get_rank())
        x, g = torch.randn(12, 16), torch.randn(12, 16)
        chunked = b.experts.chunks > 1
        if chunked:  # the loop kernel on CPU: `_run` calls the module's compute
            ec._InFlight.start, ec._InFlight.finish, ec._combine = named_start, named_finish, marked_combine
            compute, b.experts.compute = b.experts.compute, marked_compute
        try:
            xi = x.clone().requires_grad_()
            y = b(xi)
            if chunked:
                events.append("backward")
            y.backward(g)
        finally:
            ec._InFlight.start, ec._InFlight.finish, ec._combine, ec._plan = start, finish, combine, plan
        local = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for n, p in b.named_parameters()}
        results.append((y.detach(), xi.grad, local))
    (y0, gx0, p0), (y1, gx1, p1) = results
    diffs = {"out": float((y0 - y1).abs().max()), "x_grad": float((gx0 - gx1).abs().max()),
             **{n: float((p0[n] - p1[n]).abs().max()) for n in p0}}
    return {"diffs": diffs, "events": events}


@pytest.mark.parametrize("chunks, skewed", [(2, False), (3, False), (3, True)], ids=["2", "3", "3-skewed"])
def test_chunks_equal_one_exchange_and_overlap_it(worlds, chunks, skewed):
    """Chunked: one exchange's output and gradients on both ranks (also with rank 1 receiving nothing: each chunk
    computes one zero row there). Forward: chunk i+1's dispatch starts before chunk i's experts and chunk i's
    combine is waited for only after the last chunk's experts. Backward: every combine's reverse starts before
    any chunk's experts differentiate, and while chunk i differentiates chunk i+1's reverse dispatch is in flight."""
    per_rank = worlds.run(2, _chunked_block_timeline, chunks, skewed, timeout=240)
    for rank, result in enumerate(per_rank):
        # the weight gradients sum chunk by chunk: another order of fp32 adds
        assert max(result["diffs"].values()) < 1e-5, f"rank {rank}: {result['diffs']}"
        events = result["events"]
        assert events == per_rank[0]["events"], f"rank {rank}: its collectives in another order"
        at = {e: i for i, e in enumerate(events)}
        split = at["backward"]
        last = chunks - 1
        for c in range(chunks):  # forward
            assert at[f"start d{c}"] < at[f"wait d{c}"] < at[f"experts {c}"] < at[f"start c{c}"], events
            assert c == last or at[f"start c{c}"] < at[f"experts {c + 1}"], f"combine {c} after {c + 1}: {events}"
            if c < last:
                assert at[f"start d{c + 1}"] < at[f"experts {c}"], f"chunk {c + 1} not dispatched during {c}: {events}"
            assert at[f"experts {last}"] < at[f"wait c{c}"] < split, f"combine {c} waited too early: {events}"
        for c in range(chunks):  # backward
            assert split < at[f"start rc{c}"] < at[f"experts' {last}"], events
            assert at[f"wait rc{c}"] < at[f"experts' {c}"] < at[f"start rd{c}"] < at[f"wait rd{c}"], events
            if c < last:
                assert at[f"start rd{c + 1}"] < at[f"experts' {c}"] < at[f"wait rd{c + 1}"], \
                    f"chunk {c + 1}'s reverse dispatch not in flight during {c}'s backward: {events}"


if __name__ == "__main__":  # print a timeline: python tests/test_ep_chunks.py
    from harness import WorldPool

    pool = WorldPool()
    print("\n".join(pool.run(2, _chunked_block_timeline, 3, False, timeout=240)[0]["events"]))
    pool.close()
