"""Projects encoder features into the LLM's hidden size (LLaVA's two-layer MLP; Qwen2-VL's merger MLP, which keeps
its input's width in between; Qwen2-Audio's one matmul)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# the activations between the two matmuls, by their Hugging Face names (LLaVA's `projector_hidden_act`): the
# names VisionConfig.projector_act accepts (model_config.PROJECTOR_ACT_NAMES)
PROJECTOR_ACTS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "relu": F.relu,
}


class Projector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, act: str = "gelu", hidden: int = 0) -> None:
        """`hidden`: the width between the two matmuls (0: out_dim, LLaVA's)."""
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, hidden or out_dim)
        self.linear_2 = nn.Linear(hidden or out_dim, out_dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(PROJECTOR_ACTS[self.act](self.linear_1(x)))


class LinearProjector(nn.Module):
    """One matmul with a bias (Qwen2-Audio's `multi_modal_projector.linear`)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)
