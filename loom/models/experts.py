"""The routed experts of a mixture-of-experts block: E SwiGLU MLPs stacked into [E, …] tensors.

`gate_proj` and `up_proj` are [E, intermediate, hidden] and `down_proj` [E, hidden, intermediate]: expert e's
slice is the weight of an nn.Linear, as Hugging Face stores each expert (`experts.e.gate_proj.weight`), so
loading and export stack or split along dim 0 and nothing is transposed.

Two ways to compute the same thing on tokens sorted by expert:
- ``loop``: one matmul per expert, over its run of tokens (an expert with no token is skipped) — the CPU
  path and the oracle;
- ``grouped``: one grouped GEMM per projection (`grouped_mm` with the runs' end offsets), no host sync. On
  CPU it runs in fp32 when each row is a multiple of 16 bytes; on CUDA it needs bf16 and SM ≥ 80.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom.models.row_moves import inverse, take_rows

grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "grouped_mm", None)
KERNELS = ("auto", "loop", "grouped")
ROW_BYTES = 16  # a grouped GEMM's row-major operands need strides and group starts in multiples of 16 bytes


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, kernel: str = "auto") -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.kernel = kernel
        # the seam expert parallelism fills from outside (parallel/experts.py): (experts, x, counts) → outputs, in
        # place of computing every expert here; None: all experts are this module's
        self.exchange: Callable[[Experts, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # set with `exchange` (parallel.ep_chunks): the MoE block cuts its tokens into this many runs, each sorted by
        # expert, so the exchange can overlap one run's all-to-alls with another's compute (parallel/expert_chunks.py)
        self.chunks = 1

    @property
    def num_experts(self) -> int:
        return self.gate_proj.shape[0]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`x` [n, hidden]: tokens sorted by expert, `counts` [E] (int) tokens of each expert, in order; with
        `chunks` > 1 (an exchange only) `counts` [chunks, E] and `x` sorted by (chunk, expert)."""
        if self.exchange is not None:
            return self.exchange(self, x, counts)
        return self.compute(x, counts, self.gate_proj, self.up_proj, self.down_proj)

    def compute(self, x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                down: torch.Tensor, back: torch.Tensor | None = None) -> torch.Tensor:
        """The experts whose weights are given (all, or expert parallelism's local ones) on tokens `x`: sorted by
        expert, or (`back`) not, row i's place in that order back[i]. The outputs come in `x`'s order."""
        w = (gate, up, down)
        if not self.use_grouped(x):
            if back is None:
                return self._loop(x, counts, w)
            return take_rows(self._loop(take_rows(x, inverse(back)), counts, w), back)
        return self._grouped(x.to(compute_dtype(x)), counts, w, back)

    def use_grouped(self, x: torch.Tensor) -> bool:
        if self.kernel == "loop" or grouped_mm is None:
            return False
        if self.kernel == "grouped":
            return True
        # auto: the GPU's kernel where its layout rules hold (bf16, 16-byte rows); the loop elsewhere
        dtype = compute_dtype(x)
        aligned = all(n * dtype.itemsize % 16 == 0 for n in self.gate_proj.shape[1:])
        return x.is_cuda and dtype == torch.bfloat16 and aligned

    @staticmethod
    @torch.compiler.disable  # the counts read on the host: compiled, each expert's row count was a guard
    def _loop(x: torch.Tensor, counts: torch.Tensor, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
        gate, up, down = (p.to(x.dtype) for p in w)
        out = []
        start = 0
        for e, n in enumerate(counts.tolist()):  # one host read of the counts: this path is the CPU's
            if n == 0:
                continue
            xe = x[start : start + n]
            out.append((F.silu(xe @ gate[e].t()) * (xe @ up[e].t())) @ down[e].t())
            start += n
        if not out:
            # no token here at all (expert parallelism: none routed to this rank): the first expert on the empty
            # run keeps the output tied to the weights and to `x`, so the backward still reaches the all-to-all
            # that brought `x` — every rank must take part in it
            return (F.silu(x @ gate[0].t()) * (x @ up[0].t())) @ down[0].t()
        return torch.cat(out)

    @staticmethod
    def _grouped(x: torch.Tensor, counts: torch.Tensor, w: tuple[torch.Tensor, ...],
                 back: torch.Tensor | None = None) -> torch.Tensor:
        """Each group padded with zero rows (`padded_groups`): their h and outputs are exact zeros, so they add
        nothing to any gradient, and their outputs are dropped."""
        rows, dest, offsets = padded_groups(x.shape[0], counts, ROW_BYTES // x.dtype.itemsize)
        if back is not None:  # unsorted rows straight to their padded places: sorting them costs no move of its own
            dest = dest.index_select(0, back)
        x = x.new_zeros(rows, x.shape[1]).index_copy(0, dest, x)
        # FSDP2's mixed precision hands bf16 weights (`to` returns them, no copy); autocast's fp32 ones cast here
        gate, up, down = (p.to(x.dtype).transpose(-2, -1) for p in w)
        h = F.silu(grouped_mm(x, gate, offs=offsets)) * grouped_mm(x, up, offs=offsets)
        return take_rows(grouped_mm(h, down, offs=offsets), dest)


def padded_groups(n: int, counts: torch.Tensor, multiple: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """`n` rows sorted into groups of `counts`, each group padded with zero rows to a multiple of `multiple`
    (16 bytes) and the last one given the rest of a static total, at least one multiple: the total, each row's
    place and the groups' end offsets (int32). Under inductor the down projection's weight gradient takes hᵀ
    laid out densely: [intermediate, 0] on an EP rank without tokens has no valid strides (pytorch#192497), and
    the GPU kernel reads each group of a row-major operand from a 16-byte-aligned column."""
    groups = counts.numel()
    rows = (n // multiple + 1 + groups) * multiple  # ≥ n + every group's rounding + one multiple
    sizes = (counts + multiple - 1) // multiple * multiple
    ends = sizes.cumsum(0)
    shift = (ends - sizes) - (counts.cumsum(0) - counts)  # each group's padded start minus its start
    group = torch.repeat_interleave(torch.arange(groups, device=counts.device), counts, output_size=n)
    dest = torch.arange(n, device=counts.device) + shift[group]
    return rows, dest, torch.cat([ends[:-1], ends.new_full((1,), rows)]).to(torch.int32)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """What the matmuls run in: autocast's dtype when it is on (one process in bf16: the stream stays fp32),
    else x's (FSDP's mixed precision hands bf16 tokens)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype
