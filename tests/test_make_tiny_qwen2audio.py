"""examples/make_tiny_qwen2audio.py and examples/qwen2audio.toml: the folder it writes is a Qwen2-Audio folder
transformers loads with loom's logits on a clip, and the config trains on it under its layout (the tower at dp4
fanning in to the LLM at tp2·dp2) and exports a folder transformers loads again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from vlm_jobs import EXAMPLES, loaded_whole, made_example, train_example_and_export  # noqa: E402


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return made_example("make_tiny_qwen2audio", tmp_path_factory.mktemp("tiny_qwen2audio"))


def _logits_equal(folder: Path) -> None:
    """A clip of 200 mel frames in a sample: transformers' logits (its padding masked) and loom's."""
    from test_hf_qwen2audio import FRAMES, loom_clip
    from transformers import Qwen2AudioForConditionalGeneration

    from loom.data.spans import TokenSpans
    from loom.models.hf import build_pretrained
    from loom.models.qwen2_audio import pooled_rows

    ref = loaded_whole(Qwen2AudioForConditionalGeneration, folder)
    model, audio_id, frames = build_pretrained(folder), ref.config.audio_token_index, 200
    mel = torch.randn(1, 128, FRAMES, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([5, 6, *[audio_id] * pooled_rows(frames), 7, 9])
    loom_ids = torch.where(ids == audio_id, model.placeholder_ids["audio"], ids)
    with torch.no_grad():
        want = ref.eval()(input_ids=ids[None], input_features=mel,
                          feature_attention_mask=(torch.arange(FRAMES) < frames).long()[None]).logits[0]
        got = model.eval()(loom_ids, torch.arange(len(ids)), TokenSpans.from_lengths([len(ids)]),
                           {"audio": [loom_clip(mel[0], frames)]})
    assert want.abs().max() > 0.5 and (got - want).abs().max() <= 1e-5


def test_the_folder_is_a_qwen2audio_folder_transformers_reads_with_loom_s_logits(out):
    _logits_equal(out / "model")


def test_examples_qwen2audio_toml_trains_under_its_layout_and_exports(out, tmp_path):
    losses = train_example_and_export(EXAMPLES / "qwen2audio.toml", out, tmp_path / "run", tmp_path / "hf")
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
    assert {"tokenizer.json", "preprocessor_config.json"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    _logits_equal(tmp_path / "hf")
