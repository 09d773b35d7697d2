"""The ViT's position grid resized to other image sizes equals SigLIP's bicubic F.interpolate, values and
gradients (loom computes it as two small matmuls)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.models.vision import VisionConfig, VisionEncoder


@pytest.mark.parametrize("h,w", [(4, 12), (16, 16), (3, 5), (8, 20), (1, 1)])
def test_position_resize_equals_bicubic_interpolate(h, w):
    torch.manual_seed(0)
    g = 8
    enc = VisionEncoder(VisionConfig(position_grid=g, hidden_size=32)).double()
    table = enc.position_embedding.weight
    ref = F.interpolate(table.reshape(1, g, g, -1).permute(0, 3, 1, 2), size=(h, w), mode="bicubic",
                        align_corners=False).permute(0, 2, 3, 1).reshape(h * w, -1)
    upstream = torch.randn_like(ref)
    ref_grad, = torch.autograd.grad((ref * upstream).sum(), table)
    got = enc._positions(h, w)
    got_grad, = torch.autograd.grad((got * upstream).sum(), table)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_grad, ref_grad, rtol=0, atol=1e-12)
