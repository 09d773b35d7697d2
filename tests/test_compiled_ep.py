"""Compiled experts where tokens are missing: an EP rank that receives no token at all, experts that receive none
anywhere — the GPU's configuration (bf16, grouped GEMM, torch.compile) on CPU.

The GPU crash (issue 49): a rank with no token gives h [0, intermediate]; the down projection's weight gradient is
a grouped GEMM on hᵀ [intermediate, 0], which eager autograd skips and inductor emits with strides no kernel
accepts (pytorch#192497). Inductor on CPU emits the same call and fails the same way, so the first test reproduces
it (a control with the padding off) and shows the padded kernel (models/experts.py `padded_groups`) compiles
and equals eager. The second runs `loom verify` on 2 ranks with ep2 in that configuration (aot_eager: inductor's codegen
would cost CI minutes) and checks what the compiled graphs hand the kernel: no grouped GEMM with an empty operand,
every group a multiple of 16 bytes (the GPU kernel's rule for a row-major operand's groups)
"""

from __future__ import annotations

import pytest
import torch
from oracle import assert_all_passed
from test_moe_parity import MOE

import loom.models.experts as experts_module
from loom.models.experts import Experts, grouped_mm

pytestmark = pytest.mark.skipif(grouped_mm is None, reason="this torch has no grouped_mm")


def _run(e: Experts, forward, x: torch.Tensor, counts: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    e.zero_grad()
    x = x.clone().requires_grad_()
    y = forward(x, counts)
    y.backward(g)
    return [y.detach(), x.grad, *(p.grad.clone() for p in e.parameters())]


ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: the CPU rows stand for it in CI")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_GPU)])
@pytest.mark.parametrize("pad", [True, False], ids=["padded", "unpadded-control"])
def test_inductor_grouped_experts_without_tokens_equal_eager(monkeypatch, pad, device):
    """bf16 grouped experts under inductor: no row at all (an EP rank that received nothing), then rows for
    experts 0 and 3 only (1 and 2 idle). Padded: output, input and weight gradients equal eager's; unpadded: the
    compiled backward fails with the GPU's error, so this test does reach the crash. On a GPU (bench machine:
    `pytest tests/test_compiled_ep.py -k cuda`) the same with CUDA's grouped GEMM."""
    if not pad:
        monkeypatch.setattr(experts_module, "padded_groups",
                            lambda n, counts, multiple: (n, torch.arange(n, device=counts.device),
                                                         counts.cumsum(0).to(torch.int32)))
    torch._dynamo.reset()
    torch.manual_seed(0)
    e = Experts(4, 16, 8, kernel="grouped").to(device, torch.bfloat16)
    with torch.no_grad():
        for p in e.parameters():
            p.normal_(0, 0.3)
    compiled = torch.compile(e.forward, backend="inductor")
    for counts in ([0, 0, 0, 0], [3, 0, 0, 2], [9, 0, 0, 0]):
        n = sum(counts)
        x, g = (torch.randn(n, 16, dtype=torch.bfloat16, device=device) for _ in range(2))
        counts = torch.tensor(counts, device=device)
        if not pad and n == 0:
            with pytest.raises(RuntimeError, match=r"Invalid strides/sizes.*\[8, 0\] for sizes"):
                _run(e, compiled, x, counts, g)
            return
        want, got = _run(e, e.forward, x, counts, g), _run(e, compiled, x, counts, g)
        for a, b in zip(want, got):  # inductor fuses silu·up at another precision: bf16 rounding apart
            assert (b.float() - a.float()).norm() <= 1e-2 * a.float().norm(), (a, b)
        assert n == 0 or got[3][1:3].abs().max() == 0 < got[3][0].abs().max()  # idle experts: zero gradient


def test_groups_padded_by_hand():
    """5 rows in groups of 3, 0, 0, 2 (bf16: multiples of 8 rows): group 0 takes rows 0-7, the empty groups none,
    the last the rest of (5 // 8 + 1 + 4) · 8 = 40; 9 rows in one group: 16 rows, then the rest of 48. No rows: the
    last group 40 rows of padding."""
    rows, dest, ends = experts_module.padded_groups(5, torch.tensor([3, 0, 0, 2]), 8)
    assert (rows, dest.tolist(), ends.tolist()) == (40, [0, 1, 2, 8, 9], [8, 8, 8, 40])
    rows, dest, ends = experts_module.padded_groups(9, torch.tensor([9, 0, 0, 0]), 8)
    assert (rows, dest.tolist(), ends.tolist()) == (48, list(range(9)), [16, 16, 16, 48])
    rows, dest, ends = experts_module.padded_groups(0, torch.tensor([0, 0, 0, 0]), 8)
    assert (rows, dest.tolist(), ends.tolist()) == (40, [], [0, 0, 0, 40])


def _grouped_operands() -> tuple[list, list, object]:
    """A backend like aot_eager whose forward and backward graphs run node by node, recording the operand shapes
    and group offsets of every grouped GEMM they call, and every op that runs on an empty tensor."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen: list[tuple[list[tuple[int, ...]], list[int]]] = []
    empty: list[str] = []  # ops that ran on a tensor with no element

    class Record(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if "grouped_mm" in str(target):
                seen.append(([tuple(a.shape) for a in args[:2]], args[2].tolist()))
            if any(isinstance(a, torch.Tensor) and a.numel() == 0 for a in args):
                empty.append(f"{target}{[tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]}")
            return super().call_function(target, args, kwargs)

    def recorded(gm, example_inputs):
        return make_boxed_func(lambda *args: Record(gm).run(*args))

    return seen, empty, aot_autograd(fw_compiler=recorded, bw_compiler=recorded)


def _verify_skewed_compiled(overrides: list[str], steps: int) -> dict:
    """tests/test_moe_parity.py's skew (every token to experts 0 and 1, on EP rank 0), the blocks compiled with
    the recording backend in place of aot_eager. This rank's verify results and the grouped GEMMs' operands."""
    import test_moe_parity

    seen, empty, backend = _grouped_operands()
    compile_ = torch.compile

    def recording(fn, **kwargs):
        assert kwargs.get("backend") == "aot_eager", kwargs
        return compile_(fn, **{**kwargs, "backend": backend})

    torch._dynamo.reset()
    torch.compile = recording
    try:
        checks = test_moe_parity._verify_skewed(overrides, steps)
    finally:
        torch.compile = compile_
    return {"checks": checks, "operands": seen, "empty": empty}


@pytest.mark.parametrize("chunks", [1, 2], ids=["one-exchange", "chunks2"])
def test_compiled_grouped_ep_with_an_idle_rank_matches_the_reference(worlds, chunks):
    """ep2 on 2 ranks, bf16 (FSDP2 mixed precision), grouped GEMM, compiled: rank 1 receives no token and experts
    2-7 none anywhere, every step; verify passes against the one-process reference, and no grouped GEMM of the
    compiled graphs (forward and backward) has an empty operand or a group of other than a multiple of 8 bf16
    rows, although rank 1's groups are all padding. chunks2 (`parallel.ep_chunks`): each chunk's experts a
    compiled call of their own (parallel/expert_chunks.py), rank 1 computing one zero row in each."""
    overrides = MOE + ["--layout.language.ep=2", "--model.language.router_bias=true",
                       "--model.language.router_bias_update_rate=0", "--train.dtype=bf16",
                       "--model.language.expert_kernel=grouped", "--train.compile=true",
                       "--train.compile_backend=aot_eager", f"--parallel.ep_chunks={chunks}"]
    per_rank = worlds.run(2, _verify_skewed_compiled, overrides, 1, timeout=600)
    assert_all_passed(f"ep2-compiled-grouped-idle-rank-{chunks}", [r["checks"] for r in per_rank], 1)
    for rank, result in enumerate(per_rank):
        operands = result["operands"]
        assert operands, f"rank {rank}: no grouped GEMM ran in a compiled graph"
        assert all(0 not in shape for shapes, _ in operands for shape in shapes), f"rank {rank}: {operands}"
        sizes = {b - a for _, ends in operands for a, b in zip([0, *ends], ends)}
        assert all(size % 8 == 0 for size in sizes), f"rank {rank}: {sizes}"
        assert all(ends[-1] > 0 for _, ends in operands), f"rank {rank}: {operands}"
    # nothing in a compiled graph runs on 0 rows: rank 1 computes one zero row instead (torch 2.11's inductor kernels
    # fail to launch on an unbacked size of 0 — bench/ep_idle_gpu.py at ep4 on 4 H200s)
    assert not any(result["empty"] for result in per_rank), [result["empty"][:4] for result in per_rank]
    # rank 1's forward GEMMs: every group empty but for the padding, the last one's
    assert {tuple(ends) for shapes, ends in per_rank[1]["operands"] if len(shapes[1]) == 3} == {(0, 0, 0, 40)}
