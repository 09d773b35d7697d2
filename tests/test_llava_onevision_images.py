"""A LLaVA-OneVision folder's images are cut into tiles as its processor cuts them — the best canvas, the image
resized into it and centred, its tiles after a base tile; an image among several padded square and one tile — the
same pixels as transformers' LlavaOnevisionImageProcessorPil, and each image expands to as many placeholders as
LlavaOnevisionProcessor writes for it."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")
from llava_onevision_folders import FOLDERS, image_processor  # noqa: E402
from test_llava_images import _hf_tokenizer  # noqa: E402
from vlm_jobs import png_files  # noqa: E402
from transformers import LlavaOnevisionProcessor  # noqa: E402

from loom.data.anyres_images import load_tiled, tiled_file  # noqa: E402
from loom.data.conversations import parse_conversation  # noqa: E402

# (H, W): a grid cut in rows and pooled, cut in columns, cut in rows and not pooled, one tile, large, thin
SIZES = [(33, 48), (16, 40), (20, 40), (16, 16), (301, 230), (12, 70)]


def _rules(folder):
    from loom.job import load_config
    from loom.train.job_data import media_rules

    return media_rules(load_config(None, [f"--model.hf={folder}", "--data.tasks=[\"sums\"]"]))


def test_tiles_are_the_processors_pixels(llava_onevision, tmp_path):
    _, folder = llava_onevision()
    rule, processor = _rules(folder).image, image_processor()
    paths = png_files(tmp_path, SIZES)
    for path in paths:
        want = processor(images=[Image.open(path)], return_tensors="np")
        got = load_tiled(path, rule, alone=True)
        assert tiled_file(path, rule, alone=True).shape == got.shape, path.name
        assert got.size == tuple(want["image_sizes"][0])
        assert (got.tiles - torch.from_numpy(want["pixel_values"][0])).abs().max() <= 1e-5, path.name
    # two images of one sample: a base tile each, padded square with the mean's colour
    want = processor(images=[[Image.open(p) for p in paths[:2]]], return_tensors="np")["pixel_values"]
    for k, path in enumerate(paths[:2]):
        got = load_tiled(path, rule, alone=False)
        assert tiled_file(path, rule, alone=False).shape == got.shape == (1, 3, *SIZES[k]), path.name
        assert (got.tiles[0] - torch.from_numpy(want[k][0])).abs().max() <= 1e-5, path.name


def test_each_image_has_as_many_placeholders_as_the_processor_writes(llava_onevision, tmp_path, monkeypatch):
    from loom.data.conversation_format import media_items
    from loom.models.hf import build_pretrained

    _, folder = llava_onevision()
    cfg = FOLDERS["ov"]
    # without torchvision transformers cannot name the video processor's class, which this test passes as None
    checked = LlavaOnevisionProcessor.check_argument_for_proper_class
    monkeypatch.setattr(LlavaOnevisionProcessor, "check_argument_for_proper_class",
                        lambda self, name, arg: None if name == "video_processor" else checked(self, name, arg))
    processor = LlavaOnevisionProcessor(image_processor=image_processor(), tokenizer=_hf_tokenizer(tmp_path / "tok"),
                                        num_image_tokens=16, vision_feature_select_strategy="full",
                                        vision_aspect_ratio=cfg.vision_aspect_ratio)
    rules, counters = _rules(folder), {"vision": build_pretrained(folder).encoder("vision").num_tokens}
    paths = png_files(tmp_path, SIZES)
    seen = set()
    for group in [[p] for p in paths] + [paths[:2], paths[2:5]]:
        ids = processor(text="<image>" * len(group) + " what is it", images=[[Image.open(p) for p in group]])
        want = sum(i == processor.image_token_id for i in ids["input_ids"][0])
        line = {"messages": [{"role": "user", "content": [*({"type": "image", "path": p.name} for p in group),
                                                           {"type": "text", "text": "what is it"}]},
                             {"role": "assistant", "content": "a cat"}]}
        _, _, rows = media_items(parse_conversation(json.dumps(line), "data.jsonl:1", tmp_path), rules, counters)
        assert sum(rows["vision"]) == want, [p.name for p in group]
        seen |= set(rows["vision"])
    assert len(seen) >= 6 and 17 in seen  # tiled images of assorted counts, and images among several (16 + 1)
