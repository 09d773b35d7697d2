"""examples/make_tiny_qwen2vl.py and examples/qwen2vl.toml: the folder it writes is a Qwen2-VL folder transformers
loads with loom's logits, and the config trains on it under its layout (the tower at dp4 fanning in to the LLM at
cp2·dp2) and exports a folder transformers loads again."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "make_tiny_qwen2vl.py"


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_qwen2vl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    root = tmp_path_factory.mktemp("tiny_qwen2vl")
    module.main([str(root), "--train", "64", "--heldout", "4"])
    return root


def _logits_equal(folder: Path, loom_model) -> None:
    from transformers import Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from loom.data.mrope import mrope_positions
    from loom.data.spans import TokenSpans

    ref, info = Qwen2VLForConditionalGeneration.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    image_token = json.loads((folder / "config.json").read_text())["image_token_id"]
    assert loom_model.placeholder_ids["vision"] == image_token
    g = torch.Generator().manual_seed(0)
    images = [torch.randn(3, 56, 84, generator=g), torch.randn(3, 28, 56, generator=g)]
    tower = loom_model.encoder("vision")
    ids = [5, 6, *[image_token] * tower.num_tokens(images[0]), 7, *[image_token] * tower.num_tokens(images[1]), 9]
    pixels = Qwen2VLImageProcessorPil(do_resize=False, do_rescale=False, do_normalize=False)(
        images=images, return_tensors="pt")
    x = torch.tensor(ids)
    positions = torch.tensor(mrope_positions(ids, image_token, [tower.encoder.grid(im) for im in images]))
    with torch.no_grad():
        want = ref.eval()(input_ids=x[None], mm_token_type_ids=(x == image_token).int()[None],
                          pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"]).logits[0]
        got = loom_model.eval()(x, positions, TokenSpans.from_lengths([len(ids)]), {"vision": images})
    assert want.abs().max() > 0.5 and (got - want).abs().max() <= 1e-5


def test_the_folder_is_a_qwen2vl_folder_transformers_reads_with_loom_s_logits(out):
    pytest.importorskip("transformers")
    from loom.models.hf import build_pretrained

    model = build_pretrained(out / "model")
    assert model.encoder("vision").encoder.cfg.family == "qwen2_vl" and model.language.cfg.vocab_size % 64 == 0
    _logits_equal(out / "model", model)


def test_examples_qwen2vl_toml_trains_under_its_layout_and_exports(out, tmp_path):
    pytest.importorskip("transformers")
    from vlm_jobs import train_example_and_export

    from loom.models.hf import build_pretrained

    losses = train_example_and_export(SCRIPT.parent / "qwen2vl.toml", out, tmp_path / "run", tmp_path / "hf")
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
    assert {"tokenizer.json", "chat_template.json", "preprocessor_config.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()}
    _logits_equal(tmp_path / "hf", build_pretrained(tmp_path / "hf"))
