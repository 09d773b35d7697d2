"""LLaVA folders (`model_type = "llava"`): a CLIP or SigLIP tower, the MLP projector and a Llama / Qwen2 LLM in one
folder load into loom with transformers' logits, for several samples packed into one stream, each with its own
number of images (LLaVA's images are all of the tower's size)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")
from conftest import tiny_chat_tokenizer  # noqa: E402
from llava_folders import FOLDERS, IMAGE  # noqa: E402
from transformers import LlavaForConditionalGeneration  # noqa: E402

from loom.data.spans import TokenSpans  # noqa: E402
from loom.models.hf import build_pretrained  # noqa: E402

TOL = 1e-5
IMAGES_PER_SAMPLE = [2, 0, 1, 3]


def packed_samples(model, per_sample: list[int], seed: int = 0):
    """Samples of text around each one's images' placeholders: [(ids, images [n, 3, H, W])]."""
    g = torch.Generator().manual_seed(seed)
    image_id, rows = model.placeholder_ids["vision"], model.encoder("vision").num_tokens
    out = []
    for k, n in enumerate(per_sample):
        images = torch.randn(n, 3, IMAGE, IMAGE, generator=g)
        ids = torch.randint(10, 290, (3 + k,), generator=g).tolist()
        for image in images:
            ids += [image_id] * rows(image) + torch.randint(10, 290, (2,), generator=g).tolist()
        out.append((torch.tensor(ids), images))
    return out


def loom_packed_logits(model, samples) -> torch.Tensor:
    lengths = [len(ids) for ids, _ in samples]
    with torch.no_grad():
        return model(torch.cat([ids for ids, _ in samples]), torch.cat([torch.arange(n) for n in lengths]),
                     TokenSpans.from_lengths(lengths), {"vision": [im for _, images in samples for im in images]})


def hf_logits(ref, samples) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([ref(input_ids=ids[None], pixel_values=images if len(images) else None).logits[0]
                          for ids, images in samples])


@pytest.mark.parametrize("name", list(FOLDERS))
def test_a_llava_folder_gives_transformers_logits_for_packed_samples(llava, name):
    ref, folder = llava(name)
    model = build_pretrained(folder).eval()
    vision = model.vision.encoder.cfg
    assert (vision.num_layers, vision.class_token, vision.drop_first_row) == (
        (2, True, True) if name == "clip-llama" else (2, False, False))
    assert model.placeholder_ids["vision"] == FOLDERS[name].image_token_index
    samples = packed_samples(model, IMAGES_PER_SAMPLE)
    assert sum(int((ids == model.placeholder_ids["vision"]).sum()) for ids, _ in samples) == 6 * 16
    want = hf_logits(ref, samples)
    got = loom_packed_logits(model, samples)
    assert want.abs().max() > 1.0
    assert (got - want).abs().max() <= TOL


def test_a_llava_job_trains_and_exports_a_llava_folder_transformers_reads_with_equal_logits(llava, tmp_path, capsys):
    """SigLIP + Qwen2 (SigLIP's positions interpolate, so the built-in tasks' image sizes train): one step, a
    checkpoint, `loom export` → one llava folder: the trained tensors, the unread tower tensors as they were."""
    import loom.cli
    from loom.job import load_config
    from loom.train.trainer import Trainer
    from safetensors.torch import load_file

    ref, folder = llava("siglip-qwen2")
    cfg = load_config(None, [
        f"--model.hf={folder}", "--data.tasks=[\"digits\", \"shapes\"]", "--data.train_size=16",
        "--data.heldout_size=2", "--train.global_batch_size=4", "--train.steps=1", "--train.device=cpu",
        "--run.tensorboard=false", "--run.progress=false", f"--run.out_dir={tmp_path}/run", "--data.workers=0"])
    assert cfg.model.encoders == ["vision"] and cfg.model.language.hf == cfg.model.vision.hf == str(folder)
    trainer = Trainer(cfg)
    model = trainer.model
    assert torch.equal(model.vision.projector.linear_2.bias, ref.model.multi_modal_projector.linear_2.bias)
    trainer.train_step(trainer.batches.shard(0))
    assert not torch.equal(model.vision.projector.linear_2.bias, ref.model.multi_modal_projector.linear_2.bias)
    trainer.checkpoint()
    assert loom.cli.main(["export", str(tmp_path / "run" / "step-1"), "--hf", str(tmp_path / "hf")]) == 0
    capsys.readouterr()

    back, info = LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    original, exported = load_file(folder / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == original.keys()
    unread = [k for k in original if ".head." in k or "post_layernorm" in k or "encoder.layers.2." in k]
    assert unread and all(torch.equal(exported[k], original[k]) for k in unread)
    samples = packed_samples(model, IMAGES_PER_SAMPLE, seed=3)
    image_id = FOLDERS["siglip-qwen2"].image_token_index
    as_hf = [(torch.where(ids == model.placeholder_ids["vision"], image_id, ids), images) for ids, images in samples]
    want = hf_logits(back.eval(), as_hf)
    assert (loom_packed_logits(model.eval(), samples) - want).abs().max() <= TOL


def _verify_llava(overrides: list[str]) -> list[dict]:
    from oracle import run_verify

    return run_verify(overrides)


def _image_conversations(root, n: int = 16) -> Path:
    """A user's JSONL of `n` conversations with 0, 1 or 2 PNG images of assorted sizes each."""
    rng = np.random.default_rng(0)
    (root / "media").mkdir(parents=True)
    lines = []
    for i in range(n):
        content = []
        for k in range(i % 3):
            h, w = (int(x) for x in rng.integers(8, 40, size=2))
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "media" / f"{i}-{k}.png")
            content.append({"type": "image", "path": f"media/{i}-{k}.png"})
        content.append({"type": "text", "text": "What is this?"})
        lines.append(json.dumps({"messages": [{"role": "user", "content": content},
                                              {"role": "assistant", "content": f"A cat {i}."}]}))
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    return root / "data.jsonl"


def test_loom_verify_passes_for_a_llava_folder_with_the_tower_fanning_in(llava, worlds, tmp_path):
    """LLaVA 1.5's shape (CLIP, [CLS] dropped) on a user's images, sized by its processor: vision dp4 (tp1) → the
    LLM at tp2 × dp2 on 4 gloo ranks, against the one-process reference."""
    _, folder = llava("clip-llama")
    (tmp_path / "tok").mkdir()
    data = _image_conversations(tmp_path / "data")
    overrides = [f"--model.hf={folder}", f"--model.tokenizer={tiny_chat_tokenizer(tmp_path / 'tok')}",
                 f'--data.sources=[{{path = "{data}", weight = 1.0}}]', "--data.heldout_size=2",
                 "--train.global_batch_size=8", "--layout.vision.tp=1", "--layout.language.tp=2"]
    per_rank = worlds.run(4, _verify_llava, overrides, timeout=300)
    for rank, checks in enumerate(per_rank):
        assert len(checks) == 3
        for step, check in enumerate(checks):
            assert check["modules"] == ["language", "vision"]
            assert check["ref_norm"] > check["clip"], f"rank {rank} step {step + 1}: clipping not active"
            assert check["passed"], f"rank {rank} step {step + 1}: {check['failures']}"
        assert checks == per_rank[0]
