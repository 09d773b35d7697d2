"""Qwen2.5-VL's vision tower (RMSNorm, SwiGLU, attention within 112-pixel windows but in its full-attention layers) as
loom's Qwen2-VL encoder with family = "qwen2_5_vl": transformers' Qwen2_5_VisionTransformerPretrainedModel output for
images of different sizes in one packed call, windows cut short at the right and bottom edges included."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from qwen2vl_folders import far_from_init  # noqa: E402
from transformers import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig  # noqa: E402
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (  # noqa: E402
    Qwen2_5_VisionTransformerPretrainedModel,
)

from loom.models.hf.names import block_of, hf_name  # noqa: E402
from loom.models.multimodal import ModalityEncoder  # noqa: E402
from loom.models.qwen2_vision import Qwen2VisionEncoder  # noqa: E402
from loom.models.vision import VisionConfig  # noqa: E402

TOL = 1e-5
# (H, W) pixels; windows of 112 pixels = 4 × 4 merged tokens: one image of 2 × 3 windows (the last cut short), one
# inside a window, one of 2 × 1
SIZES = [(224, 280), (56, 84), (140, 56)]
TOWER = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
             spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1])


def test_the_qwen2_5_vl_tower_gives_transformers_rows_for_images_of_different_sizes():
    torch.manual_seed(0)
    ref = far_from_init(Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**TOWER))).eval()
    cfg = VisionConfig(family="qwen2_5_vl", patch_size=14, hidden_size=32, num_layers=3, num_heads=2,
                       intermediate_size=48, window_size=112, full_attention_layers=[1])
    enc = Qwen2VisionEncoder(cfg)
    tower = ModalityEncoder(enc, 64, "gelu", hidden=enc.out_dim)
    state = {"visual." + k: v for k, v in ref.state_dict().items()}
    fam = "qwen2_5_vl_vision"  # the tower's q/k/v: row blocks of the folder's fused qkv
    tower.encoder.load_state_dict({n: block_of(state[hf_name("vision", n, "visual.", fam)], n, fam)
                                   for n in tower.encoder.state_dict()})
    tower.projector.load_state_dict({n: state[hf_name("projector", n, "visual.", "qwen2_5_vl")]
                                     for n in tower.projector.state_dict()})
    tower.eval()
    g = torch.Generator().manual_seed(0)
    images = [torch.randn(3, h, w, generator=g) for h, w in SIZES]
    hf = Qwen2VLImageProcessorPil(do_resize=False, do_rescale=False, do_normalize=False)(images=images,
                                                                                          return_tensors="pt")
    with torch.no_grad():
        want = ref(hf["pixel_values"], grid_thw=hf["image_grid_thw"]).pooler_output
        got = tower(images)
    assert want.abs().max() > 1.0
    assert (got - want).abs().max() <= TOL
