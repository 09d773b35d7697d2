"""Block-quantized fp8 folders (`quant_method = "fp8"` with `weight_block_size`, as DeepSeek-V3/R1 ship): each
quantized Linear weight `X.weight` is float8 beside `X.weight_scale_inv`, one fp32 factor per block of
[rows, cols] = `weight_block_size` (DeepSeek's: 128 × 128), the last blocks cut short. loom reads such a weight
dequantized — each element times its block's factor, in fp32, as DeepSeek's own fp8 → bf16 conversion computes
it (kept in fp32 here) — one box at a time, so a rank reads only the blocks of its shard.
"""

from __future__ import annotations

import math

import torch

from loom.models.hf.errors import HFError

SCALES = "_scale_inv"  # a quantized weight's factors: its name + this


def weight_blocks(hf: dict, where: str) -> tuple[int, int] | None:
    """The block shape of a block-quantized fp8 folder; None for an unquantized one; other quantizations refused."""
    q = hf.get("quantization_config")
    if not q:
        return None
    block = q.get("weight_block_size")
    if q.get("quant_method") != "fp8" or not block or len(block) != 2:
        raise HFError(f"{where}: quantization {q} is not supported: loom reads unquantized folders and block-wise "
                      f"fp8 ones (quant_method 'fp8' with a weight_block_size, as DeepSeek-V3 ships)")
    return int(block[0]), int(block[1])


def dequantized(weight, scales, box: tuple[slice, slice], block: tuple[int, int]) -> torch.Tensor:
    """The part `box` of a quantized weight, dequantized; `weight` and `scales`: the two tensors' safetensors
    slices (read only in the box and the blocks it touches)."""
    (rows, cols), (b_rows, b_cols) = box, block
    first_r, first_c = rows.start // b_rows, cols.start // b_cols
    factors = scales[first_r : math.ceil(rows.stop / b_rows), first_c : math.ceil(cols.stop / b_cols)].float()
    factors = factors.repeat_interleave(b_rows, 0).repeat_interleave(b_cols, 1)
    r, c = rows.start - first_r * b_rows, cols.start - first_c * b_cols
    return weight[rows, cols].float() * factors[r : r + rows.stop - rows.start, c : c + cols.stop - cols.start]
