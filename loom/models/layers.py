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
    """Inverse frequencies of rotary embedding, with the rope scalings found in Llama/Qwen/DeepSeek configs."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind in ("default", "mrope"):  # transformers 4's Qwen2-VL names its M-RoPE "mrope": default frequencies
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; use one of: default, linear, llama3, yarn, mrope")


def rope_type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


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


def _yarn_inv_freq(dim: int, theta: float, s: dict) -> torch.Tensor:
    # YaRN: frequencies that turn fewer than beta_slow times over the original length are divided by `factor`,
    # those turning more than beta_fast times kept, a linear ramp between (dims rounded outward unless truncate)
    def turns_at(rotations: float) -> float:  # the dim whose frequency turns `rotations` times over that length
        return dim * math.log(s["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turns_at(s.get("beta_fast") or 32), turns_at(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    wavelengths = theta ** (torch.arange(0, dim, 2).float() / dim)
    return 1.0 / (s["factor"] * wavelengths) * ramp + 1.0 / wavelengths * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor YaRN multiplies cos and sin by (1 for every other rope type): `attention_factor` when given,
    else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set (DeepSeek), else mscale(factor)."""
    if rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dims = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dims:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dims)
    return yarn_mscale(factor)


class Rotary(nn.Module):
    """Rotary embedding for explicit positions, so packed samples restart at 0 and CP keeps global ones.

    M-RoPE (Qwen2-VL: `mrope_section` in the rope scaling): positions carry three streams (time, height, width) in
    a trailing dim, and frequency j turns with stream 0 for the first section's j, 1 for the next, 2 for the last."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.attention_factor = rope_attention_factor(scaling)
        self.sections = list((scaling or {}).get("mrope_section") or [])
        if self.sections and sum(self.sections) != head_dim // 2:
            raise ValueError(f"rope_scaling.mrope_section {self.sections} must sum to half the rotary dims, "
                             f"{head_dim // 2}")
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self.register_buffer("stream", self._streams(), persistent=False)

    def _streams(self) -> torch.Tensor:
        """Which position stream each frequency reads (M-RoPE); empty otherwise."""
        return torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(self.sections)]
                         or [torch.zeros(0, dtype=torch.long)])

    def reset_buffers(self) -> None:
        """Recomputes the frequencies (after a module built on `meta` gets storage), in fp32 whatever the
        module's dtype: bf16 frequencies would shift every rotation."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(self.inv_freq.device)
        self.stream = self._streams().to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, token_dims: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`token_dims`: the tokens' dims (1 packed, 2 padded); an M-RoPE model given one stream per token
        (text alone) uses it for all three."""
        if self.sections:
            if positions.dim() == token_dims:
                positions = positions.unsqueeze(-1).expand(*positions.shape, 3)
            freqs = positions.float().index_select(-1, self.stream) * self.inv_freq.float()
        else:
            freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)[..., None, :]  # broadcast over heads
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates [..., heads, head_dim] with the half-split convention of Llama/Qwen checkpoints; a table narrower
    than the head rotates its first dims only, the rest passing through (GLM-4.5's partial rotary)."""
    if cos.shape[-1] < x.shape[-1]:
        dims = cos.shape[-1]
        return torch.cat([apply_rotary(x[..., :dims], cos, sin), x[..., dims:]], -1)
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


def encoder_act(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The encoders' activations: exact gelu ("none"), SigLIP's tanh gelu ("tanh"), CLIP's quick_gelu ("quick")."""
    if kind == "quick":
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x, approximate=kind)


class GeluMLP(nn.Module):
    """Two-layer MLP of ViT/SigLIP/CLIP/Whisper; `approximate`: an encoder_act kind ("tanh": SigLIP's
    gelu_pytorch_tanh, "quick": CLIP's quick_gelu)."""

    def __init__(self, dim: int, hidden: int, approximate: str = "none") -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(encoder_act(self.fc1(x), self.approximate))
