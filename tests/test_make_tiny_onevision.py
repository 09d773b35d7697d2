"""examples/make_tiny_onevision.py and examples/onevision.toml: the folder it writes is a LLaVA-OneVision folder
transformers loads with loom's logits on a tiled image, and the config trains on it under its layout (the tower at dp4
fanning in to the LLM at tp2·dp2) and exports a folder transformers loads again."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from vlm_jobs import EXAMPLES, loaded_whole, made_example, train_example_and_export  # noqa: E402


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return made_example("make_tiny_onevision", tmp_path_factory.mktemp("tiny_onevision"))


def _logits_equal(folder: Path) -> None:
    """A 2 × 2-tile image (its map pooled) alone in a sample: transformers' logits and loom's."""
    from transformers import LlavaOnevisionForConditionalGeneration

    from loom.data.anyres import TiledImage
    from loom.data.spans import TokenSpans
    from loom.models.hf import build_pretrained

    ref = loaded_whole(LlavaOnevisionForConditionalGeneration, folder)
    model = build_pretrained(folder)
    tile, (h, w) = ref.config.vision_config.image_size, (60, 50)
    n = 1 + math.prod(model.vision.tiles.anyres.grid(h, w))
    image = TiledImage(torch.randn(n, 3, tile, tile, generator=torch.Generator().manual_seed(0)), (h, w))
    rows = model.encoder("vision").num_tokens(image)
    ids = torch.tensor([5, 6, *[ref.config.image_token_index] * rows, 7, 9])
    loom_ids = torch.where(ids == ref.config.image_token_index, model.placeholder_ids["vision"], ids)
    with torch.no_grad():
        want = ref.eval()(input_ids=ids[None], pixel_values=image.tiles[None], image_sizes=torch.tensor([[h, w]]),
                          batch_num_images=torch.tensor([1])).logits[0]
        got = model.eval()(loom_ids, torch.arange(len(ids)), TokenSpans.from_lengths([len(ids)]), {"vision": [image]})
    assert n == 5 and want.abs().max() > 0.5 and (got - want).abs().max() <= 1e-5


def test_the_folder_is_a_onevision_folder_transformers_reads_with_loom_s_logits(out):
    _logits_equal(out / "model")


def test_examples_onevision_toml_trains_under_its_layout_and_exports(out, tmp_path):
    losses = train_example_and_export(EXAMPLES / "onevision.toml", out, tmp_path / "run", tmp_path / "hf")
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
    assert {"tokenizer.json", "chat_template.json", "preprocessor_config.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()}
    _logits_equal(tmp_path / "hf")
