"""Image files → vision-encoder inputs (loom/data/images.py): sizes in whole patches within the pixel bounds,
aspect ratio kept, values normalised with the folder's mean and std; an undecodable file names itself."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from loom.data.images import ImageRule, load_image, target_size

RULE = ImageRule.of(patch=14, min_pixels=56 * 56, max_pixels=224 * 224)


@pytest.mark.parametrize("size,want", [
    ((224, 224), (224, 224)),  # already whole patches, within bounds
    ((230, 100), (224, 98)),  # each side rounded to the nearest multiple of 14
    ((1000, 500), (308, 154)),  # too many pixels: scaled down by √(500000 / 50176), floored to patches
    ((20, 30), (56, 70)),  # too few: scaled up by √(3136 / 600) = 2.29, ceiled to patches
    ((10, 4000), (14, 3584)),  # extreme: a side never falls under one patch, the other gives way
])
def test_target_size_by_hand(size, want):
    assert target_size(*size, RULE) == want


def test_target_size_keeps_bounds_and_aspect():
    for h in range(14, 1400, 97):
        for w in range(14, 1400, 89):
            H, W = target_size(h, w, RULE)
            assert H % 14 == 0 and W % 14 == 0 and H * W <= RULE.max_pixels
            if min(h, w) >= 56 and max(h, w) / min(h, w) < 4:
                assert H * W >= RULE.min_pixels and abs(H / W - h / w) <= 0.35 * h / w


def test_load_image_normalises_with_the_folder_mean_and_std(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.2, 0.4, 0.6],
                                                                   "image_std": [0.5, 0.25, 0.1]}))
    rule = ImageRule.of(14, 28 * 28, 56 * 56, tmp_path)
    pixels = np.zeros((28, 42, 3), dtype=np.uint8)
    pixels[..., 0], pixels[..., 1], pixels[..., 2] = 255, 102, 0
    Image.fromarray(pixels).save(tmp_path / "x.png")
    x = load_image(tmp_path / "x.png", rule)
    assert x.shape == (3, 28, 42)
    want = torch.tensor([(1.0 - 0.2) / 0.5, (0.4 - 0.4) / 0.25, (0.0 - 0.6) / 0.1]).view(3, 1, 1)
    assert torch.allclose(x, want.expand_as(x), atol=1e-5)


def test_an_undecodable_image_names_the_sample_and_the_file(tmp_path):
    (tmp_path / "bad.jpg").write_bytes(b"not an image")
    with pytest.raises(ValueError, match=r"data\.jsonl:3: cannot decode image '.*bad\.jpg'"):
        load_image(tmp_path / "bad.jpg", RULE, "data.jsonl:3")


def test_bad_pixel_bounds_are_refused():
    with pytest.raises(ValueError, match="min_pixels"):
        ImageRule.of(14, 100, 50_000)
