"""examples/make_tiny_llava.py and examples/llava.toml, docs/hf.md's "Fine-tune a released model": the folder it writes
is a LLaVA folder transformers loads with loom's logits, and the config trains on it under its layout (the tower
fanning in to the LLM at tp2) and exports a folder transformers loads again."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "make_tiny_llava.py"


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_llava", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    root = tmp_path_factory.mktemp("tiny_llava")
    module.main([str(root), "--train", "64", "--heldout", "4"])
    return root


def _logits_equal(folder: Path, loom_model) -> None:
    from transformers import LlavaForConditionalGeneration

    from loom.data.spans import TokenSpans

    ref, info = LlavaForConditionalGeneration.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    image_token = json.loads((folder / "config.json").read_text())["image_token_index"]
    images = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(0))
    rows = loom_model.encoder("vision").num_tokens(images[0])
    ids = torch.tensor([5, 6, *[image_token] * rows, 7, *[image_token] * rows, 9])
    loom_ids = torch.where(ids == image_token, loom_model.placeholder_ids["vision"], ids)
    with torch.no_grad():
        want = ref.eval()(input_ids=ids[None], pixel_values=images).logits[0]
        got = loom_model.eval()(loom_ids, torch.arange(len(ids)), TokenSpans.from_lengths([len(ids)]),
                                {"vision": list(images)})
    assert want.abs().max() > 0.5 and (got - want).abs().max() <= 1e-5


def test_the_folder_is_a_llava_folder_transformers_reads_with_loom_s_logits(out):
    pytest.importorskip("transformers")
    from loom.models.hf import build_pretrained

    model = build_pretrained(out / "model")
    assert model.encoder("vision").encoder.cfg.class_token and model.language.cfg.vocab_size % 64 == 0
    _logits_equal(out / "model", model)


def test_examples_llava_toml_trains_under_its_layout_and_exports(out, tmp_path):
    pytest.importorskip("transformers")
    from vlm_jobs import train_example_and_export

    from loom.models.hf import build_pretrained

    losses = train_example_and_export(SCRIPT.parent / "llava.toml", out, tmp_path / "run", tmp_path / "hf")
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
    assert {"tokenizer.json", "chat_template.json", "preprocessor_config.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()}
    _logits_equal(tmp_path / "hf", build_pretrained(tmp_path / "hf"))
