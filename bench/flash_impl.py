"""Switching aten's flash attention to another implementation (torch.nn.attention.activate_flash_attention_impl).

torch 2.11's FA4 adapter (torch/nn/attention/_fa4.py) unpacks `flash_attn.cute.interface._flash_attn_fwd` into
(out, lse); flash-attn-4 4.0.0b36 returns five values (out, lse, p, row_max, o_lo): the first two are wrapped
out for it, or every call fails with "too many values to unpack (expected 2)".
"""

from __future__ import annotations

import functools

import torch


def activate(impl: str) -> None:
    if impl == "FA4":
        import flash_attn.cute.interface as fa4

        fwd = fa4._flash_attn_fwd
        if not getattr(fwd, "_two_outputs", False):
            @functools.wraps(fwd)  # its attributes too: FA4 keeps its kernel cache on the function
            def two_outputs(*args, **kwargs):
                return tuple(fwd(*args, **kwargs)[:2])
            two_outputs._two_outputs = True
            fa4._flash_attn_fwd = two_outputs
    torch.nn.attention.activate_flash_attention_impl(impl)
