"""examples/make_tiny_qwen2vl.py and examples/qwen2vl.toml: the folder it writes is a Qwen2-VL folder transformers
loads with loom's logits, and the config trains on it under its layout (the tower at dp4 fanning in to the LLM at
cp2·dp2) and exports a folder transformers loads again; with `--family qwen2_5_vl` a Qwen2.5-VL folder (windows)
transformers loads with loom's logits, and examples/qwen2_5_vl.toml loads it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "make_tiny_qwen2vl.py"


def _made(root: Path, *args: str) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_qwen2vl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([str(root), "--train", "64", "--heldout", "4", *args])
    return root


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return _made(tmp_path_factory.mktemp("tiny_qwen2vl"))


def _logits_equal(folder: Path, loom_model, images: tuple[tuple[int, int], ...] = ((56, 84), (28, 56))) -> None:
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    from loom.data.mrope import mrope_positions
    from loom.data.spans import TokenSpans

    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    ref, info = getattr(transformers, architecture).from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    image_token = json.loads((folder / "config.json").read_text())["image_token_id"]
    assert loom_model.placeholder_ids["vision"] == image_token
    g = torch.Generator().manual_seed(0)
    images = [torch.randn(3, h, w, generator=g) for h, w in images]
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


def test_the_qwen2_5_vl_folder_transformers_reads_with_loom_s_logits_and_its_toml_loads(tmp_path):
    """`--family qwen2_5_vl`: a Qwen2.5-VL folder (RMSNorm, SwiGLU, 112-pixel windows, one whole-image layer) that
    Qwen2_5_VLForConditionalGeneration reads with loom's logits on an image of several windows; its TOML loads."""
    pytest.importorskip("transformers")
    from loom.job import load_config
    from loom.models.hf import build_pretrained

    root = _made(tmp_path / "runs" / "tiny_qwen2_5_vl", "--family", "qwen2_5_vl")
    model = build_pretrained(root / "model")
    tower = model.encoder("vision").encoder.cfg
    assert tower.family == "qwen2_5_vl" and tower.window_size == 112 and tower.full_attention_layers == [1]
    _logits_equal(root / "model", model, ((224, 168), (28, 56)))  # 8 × 6 merged tokens: 2 × 2 windows
    toml = (SCRIPT.parent / "qwen2_5_vl.toml").read_text().replace("../runs/", f"{tmp_path}/runs/")
    (tmp_path / "job.toml").write_text(toml)
    cfg = load_config(tmp_path / "job.toml", [])
    assert cfg.model.vision.family == "qwen2_5_vl" and cfg.layout.vision.sequence_parallel
