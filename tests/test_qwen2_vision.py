"""Qwen2-VL's vision tower as a loom encoder (its merger's MLP the projector) gives transformers'
Qwen2VisionTransformerPretrainedModel output for several images of different sizes in one packed call; the patches
transformers' image processor flattens come from loom's [C, H, W] images in the same order."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from qwen2vl_folders import TOWER, qwen2vl_model  # noqa: E402
from transformers import Qwen2VLImageProcessorPil  # noqa: E402

from loom.models.hf.names import block_of, hf_name  # noqa: E402
from loom.models.multimodal import ModalityEncoder  # noqa: E402
from loom.models.qwen2_vision import Qwen2VisionEncoder  # noqa: E402
from loom.models.vision import VisionConfig  # noqa: E402

TOL = 1e-5
SIZES = [(28, 56), (56, 84), (28, 28), (84, 56)]  # pixels (H, W): each side whole 28-pixel groups
# Qwen2-VL's tower sizes as loom reads them (14-pixel patches, 2×2 merger)
TOWER_CONFIG = VisionConfig(family="qwen2_vl", patch_size=14, hidden_size=32, num_heads=2)


def loom_tower(ref) -> ModalityEncoder:
    cfg = VisionConfig(family="qwen2_vl", patch_size=14, hidden_size=TOWER["embed_dim"], num_layers=TOWER["depth"],
                       num_heads=TOWER["num_heads"], intermediate_size=TOWER["embed_dim"] * TOWER["mlp_ratio"],
                       act="quick", layer_norm_eps=1e-6)
    enc = Qwen2VisionEncoder(cfg)
    tower = ModalityEncoder(enc, ref.config.text_config.hidden_size, "gelu", hidden=enc.out_dim)
    # the folder's names as the loader maps them (transformers 5 holds the tower as model.visual in memory)
    state = ref.state_dict()
    fam = "qwen2_vl_vision"  # the tower's q/k/v: row blocks of the folder's fused qkv
    tower.encoder.load_state_dict({n: block_of(state[hf_name("vision", n, "model.visual.", fam)], n, fam)
                                   for n in tower.encoder.state_dict()})
    tower.projector.load_state_dict({n: state[hf_name("projector", n, "model.visual.", "qwen2_vl")]
                                     for n in tower.projector.state_dict()})
    return tower.eval()


def test_the_qwen2_vl_tower_gives_transformers_rows_for_images_of_different_sizes():
    ref = qwen2vl_model()
    tower = loom_tower(ref)
    g = torch.Generator().manual_seed(0)
    images = [torch.randn(3, h, w, generator=g) for h, w in SIZES]
    # transformers' processor only flattens here (no resize, rescale or normalisation): the patch order under test
    hf = Qwen2VLImageProcessorPil(do_resize=False, do_rescale=False, do_normalize=False)(images=images,
                                                                                          return_tensors="pt")
    assert hf["image_grid_thw"].tolist() == [list(tower.encoder.grid(im)) for im in images]
    with torch.no_grad():
        want = ref.model.visual(hf["pixel_values"], grid_thw=hf["image_grid_thw"]).pooler_output
        got = tower(images)
    assert got.shape == (sum(tower.num_tokens(im) for im in images), ref.config.text_config.hidden_size)
    assert want.abs().max() > 1.0
    assert (got - want).abs().max() <= TOL
    # each image attends alone: the first image's rows do not move when the others go
    with torch.no_grad():
        alone = tower(images[:1])
    assert (alone - want[: len(alone)]).abs().max() <= TOL


def test_the_qwen2_vl_tower_refuses_an_image_of_partial_merger_groups():
    enc = Qwen2VisionEncoder(TOWER_CONFIG)
    with pytest.raises(ValueError, match="multiples of patch_size · merge_size = 28"):
        enc.num_tokens(torch.zeros(3, 28, 42))
