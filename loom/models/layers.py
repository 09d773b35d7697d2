"""Building blocks shared by the models: norms, rotary position embedding, MLPs."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


class RMSNorm(nn.Module):
    """Llama/Qwen RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies of rotary embedding, with the rope scalings found in Llama/Qwen configs."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; use one of: default, linear, llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """Rotary embedding for explicit positions, so packed samples restart at 0 and CP keeps global ones."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def reset_buffers(self) -> None:
        """Recomputes the frequencies (after a module built on `meta` gets storage), in fp32 whatever the
        module's dtype: bf16 frequencies would shift every rotation."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)[..., None, :]  # broadcast over heads
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates [..., heads, head_dim] with the half-split convention of Llama/Qwen checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    # in x's dtype: under autocast q/k are bf16 while the table follows fp32 hidden states; promoting q/k
    # to fp32 here would keep attention off the bf16 FlashAttention path
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def project(x: torch.Tensor, linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """Each of `linears` applied to `x`, as one matmul over their weights concatenated when that is safe.

    The parameters stay separate (Hugging Face names, checkpoints, TP plans); the concatenation happens at run
    time, where compiled code fuses it into the weights' bf16 cast. One wide matmul instead of three narrow ones:
    Qwen2.5-1.5B's 256-wide K/V projections ran 1.9x faster fused on an H200 (bench/kernel_probe.py). Not fused
    under tensor parallel (a DTensor weight, or a module hook that places the input): each linear runs then."""
    if any(isinstance(m.weight, DTensor) or m._forward_hooks or m._forward_pre_hooks for m in linears):
        return tuple(m(x) for m in linears)
    bias = None
    if any(m.bias is not None for m in linears):  # Whisper's key projection alone has none: zeros in its place
        bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])
    out = F.linear(x, torch.cat([m.weight for m in linears]), bias)
    return out.split([m.out_features for m in linears], dim=-1)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(nn.Module):
    """Two-layer MLP of ViT/SigLIP/Whisper; `approximate='tanh'` is SigLIP's gelu_pytorch_tanh."""

    def __init__(self, dim: int, hidden: int, approximate: str = "none") -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))
