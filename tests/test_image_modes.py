"""Images as a Hugging Face processor sees them (loom/data/image_modes.py, images.py): every Pillow mode, EXIF
orientation and the folder's preprocessing, each compared with transformers' own utilities — `load_image`,
`convert_to_rgb` inside SiglipImageProcessorPil — on the same file at the same size."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

transformers = pytest.importorskip("transformers")
from transformers.image_utils import load_image as hf_load_image  # noqa: E402
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil  # noqa: E402

from loom.data.images import ImageRule, image_file, load_image  # noqa: E402

# not the defaults: each must be read from the folder for the comparisons to hold
PREPROCESSING = {"image_mean": [0.48, 0.45, 0.41], "image_std": [0.27, 0.26, 0.28], "rescale_factor": 0.5 / 255,
                 "resample": int(Image.Resampling.BILINEAR)}


def _rule(tmp_path) -> ImageRule:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSING))
    return ImageRule.of(14, 56 * 56, 112 * 112, tmp_path)


def _processor(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """transformers' pixel values at (height, width) (its do_convert_rgb: convert_to_rgb, alpha onto white)."""
    proc = SiglipImageProcessorPil(size={"height": height, "width": width}, **PREPROCESSING)
    return torch.from_numpy(np.asarray(proc(image, return_tensors="np")["pixel_values"][0]))


def _rng_pixels(h: int, w: int, channels: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, channels), dtype=np.uint8)


def _rgba(path) -> None:
    pixels = _rng_pixels(45, 70, 4)
    pixels[:20, :, 3] = 0  # transparent, hiding random colours
    Image.fromarray(pixels, "RGBA").save(path)


def _la(path) -> None:
    pixels = _rng_pixels(45, 70, 2)
    pixels[:, :30, 1] = 0
    Image.fromarray(pixels, "LA").save(path)


def _palette_with_transparency(path) -> None:
    img = Image.fromarray(_rng_pixels(45, 70, 3)).quantize(16)
    img.info["transparency"] = 3  # palette entry 3 is transparent
    img.save(path, transparency=3)


def _cmyk(path) -> None:
    Image.fromarray(_rng_pixels(45, 70, 4), "CMYK").save(path)


def _grey(path) -> None:
    Image.fromarray(_rng_pixels(45, 70, 1)[..., 0], "L").save(path)


MODES = {"rgba.png": _rgba, "la.png": _la, "palette.png": _palette_with_transparency, "cmyk.tiff": _cmyk,
         "grey.png": _grey}


@pytest.mark.parametrize("name", list(MODES))
def test_each_mode_comes_out_as_transformers_processor_gives_it(tmp_path, name):
    MODES[name](tmp_path / name)
    x = load_image(tmp_path / name, _rule(tmp_path))
    # load_image's exif_transpose, but not its convert("RGB"), which would drop the alpha the processor composites
    want = _processor(ImageOps.exif_transpose(Image.open(tmp_path / name)), *x.shape[1:])
    assert x.shape == want.shape and torch.allclose(x, want, atol=1e-5), (x - want).abs().max()


def test_a_photo_stored_turned_is_fed_upright_as_load_image_gives_it(tmp_path):
    path = tmp_path / "turned.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    Image.fromarray(_rng_pixels(45, 70, 3)).save(path, exif=exif, quality=95)
    rule = _rule(tmp_path)
    media = image_file(path, rule)
    x = media.load()  # the header's promise (shape) checked against the decoded tensor
    upright = hf_load_image(str(path))
    assert (upright.height, upright.width) == (70, 45)
    want = _processor(upright, *x.shape[1:])
    assert x.shape[1] > x.shape[2] and torch.allclose(x, want, atol=1e-5), (x - want).abs().max()


def test_a_16_bit_greyscale_keeps_its_gradient(tmp_path):
    """transformers' own convert_to_rgb clips 16-bit values to 255 (white); loom scales them to 8 bits, so the
    reference is the processor on the same picture stored in 8 bits."""
    wide = np.linspace(0, 65535, 45 * 70).reshape(45, 70).astype(np.uint16)
    Image.fromarray(wide).save(tmp_path / "wide.png")
    assert Image.open(tmp_path / "wide.png").mode.startswith("I")
    x = load_image(tmp_path / "wide.png", _rule(tmp_path))
    eight = Image.fromarray(np.round(wide / 257.0).astype(np.uint8), "L")
    want = _processor(eight, *x.shape[1:])
    assert torch.allclose(x, want, atol=1e-5), (x - want).abs().max()
    assert (x == x.max()).float().mean() < 0.05  # not saturated


def test_the_orientation_is_read_from_the_header_alone(tmp_path):
    """A truncated PNG's size (and orientation) still reads; only decoding finds it bad — Pillow's getexif()
    would decode the whole PNG looking for a late eXIf chunk."""
    Image.fromarray(_rng_pixels(45, 70, 3)).save(tmp_path / "x.png")
    data = (tmp_path / "x.png").read_bytes()
    (tmp_path / "x.png").write_bytes(data[: len(data) // 2])
    media = image_file(tmp_path / "x.png", _rule(tmp_path), "data.jsonl:3")
    with pytest.raises(ValueError, match=r"data\.jsonl:3: cannot decode image"):
        media.load()


@pytest.mark.parametrize("bad, message", [
    ({"resample": 9}, r"resample = 9 is not a Pillow filter"),
    ({"rescale_factor": "x"}, r"could not convert string to float"),
    ({"image_std": [0.5, 0.0, 0.5]}, r"image_std = \[0\.5, 0\.0, 0\.5\]: need three of each, every std > 0"),
])
def test_an_unusable_preprocessor_config_is_a_config_error_naming_the_folder(tmp_path, bad, message):
    from loom.config import ConfigError, read_config
    from loom.train.job_data import media_rules

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSING, **bad}))
    cfg = read_config(None, [f"--model.vision.hf={tmp_path}"])
    named = rf"model\.vision\.hf = '{tmp_path}': .*preprocessor_config\.json: .*{message}"
    with pytest.raises(ConfigError, match=named):
        media_rules(cfg)
