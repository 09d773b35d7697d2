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
from oracle import assert_all_passed  # noqa: E402

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


@pytest.mark.parametrize("source_dtype", [torch.float32, torch.bfloat16])
def test_a_llava_job_trains_and_exports_a_llava_folder_transformers_reads_with_equal_logits(
        llava, tmp_path, capsys, source_dtype):
    """SigLIP + Qwen2 (SigLIP's positions interpolate, so the built-in tasks' image sizes train): one step in fp32, a
    checkpoint, `loom export` → one llava folder in fp32: the trained tensors, the unread tower tensors as they
    were (a bf16 folder's cast up)."""
    from vlm_jobs import one_step_exported

    from loom.job import load_config
    from loom.train.trainer import Trainer

    ref, folder = llava("siglip-qwen2")
    if source_dtype != torch.float32:  # the folder as released models are stored; transformers' model stays fp32
        LlavaForConditionalGeneration.from_pretrained(folder, dtype=source_dtype).save_pretrained(tmp_path / "half")
        folder, ref = tmp_path / "half", LlavaForConditionalGeneration.from_pretrained(tmp_path / "half").eval()
    cfg = load_config(None, [
        f"--model.hf={folder}", "--data.tasks=[\"digits\", \"shapes\"]", "--data.train_size=16",
        "--data.heldout_size=2", "--train.global_batch_size=4", "--train.steps=1", "--train.device=cpu",
        "--run.tensorboard=false", "--run.progress=false", f"--run.out_dir={tmp_path}/run", "--data.workers=0"])
    assert cfg.model.encoders == ["vision"] and cfg.model.language.hf == cfg.model.vision.hf == str(folder)
    trainer = Trainer(cfg)
    model = trainer.model
    assert torch.equal(model.vision.projector.linear_2.bias, ref.model.multi_modal_projector.linear_2.bias)
    back, original, exported = one_step_exported(trainer, tmp_path / "hf", LlavaForConditionalGeneration, folder)
    capsys.readouterr()
    assert not torch.equal(model.vision.projector.linear_2.bias, ref.model.multi_modal_projector.linear_2.bias)
    unread = [k for k in original if ".head." in k or "post_layernorm" in k or "encoder.layers.2." in k]
    assert unread and all(torch.equal(exported[k], original[k].float()) for k in unread)
    assert {t.dtype for t in exported.values()} == {torch.float32}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
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


# LLaVA 1.5's shape (CLIP, [CLS] dropped) under layouts (world size, overrides); 2-rank worlds first (the pool keeps
# two worlds alive)
LAYOUTS = {
    "vision-tp2-sp-fan-out": (2, ["--layout.vision.tp=2", "--layout.vision.sequence_parallel=true"]),  # dp1 → dp2
    "llm-cp2": (2, ["--layout.language.cp=2", "--data.pad_to_multiple=4"]),  # vision dp2 → LLM cp2
    "llm-pp2": (2, ["--layout.language.pp=2", "--train.microbatches=2", "--data.tokens_per_microbatch=512"]),
    "vision-dp4-fan-in-llm-tp2": (4, ["--layout.vision.tp=1", "--layout.language.tp=2"]),  # dp4 → tp2 × dp2
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loom_verify_passes_for_a_llava_folder_under_layouts(llava, worlds, tmp_path, name):
    """A user's images, sized by the folder's processor, on gloo ranks against the one-process reference."""
    _, folder = llava("clip-llama")
    (tmp_path / "tok").mkdir()
    data = _image_conversations(tmp_path / "data")
    world, layout = LAYOUTS[name]
    overrides = [f"--model.hf={folder}", f"--model.tokenizer={tiny_chat_tokenizer(tmp_path / 'tok')}",
                 f'--data.sources=[{{path = "{data}", weight = 1.0}}]', "--data.heldout_size=2",
                 "--train.global_batch_size=8", *layout]
    per_rank = worlds.run(world, _verify_llava, overrides, timeout=300)
    assert_all_passed(name, per_rank, 3, ("language", "vision"))


@pytest.mark.parametrize("overrides,fragments", [
    # an encoder pipeline passes as many rows between stages as the tower outputs: one per image too few here
    (['--layout.vision.ranks="0-1"', '--layout.language.ranks="2-3"', "--layout.vision.pp=2"],
     ["vision: pp = 2", "drops each image's first row", "layout.vision.pp = 1"]),
    (["--model.language.hf={other}"], ["model.hf", "model.language.hf", "remove one"]),
])
def test_a_layout_or_folder_a_llava_model_cannot_take_is_named_when_the_config_loads(llava, overrides, fragments):
    from loom.job import load_config
    from loom.typed_config import ConfigError

    _, folder = llava("clip-llama")
    _, other = llava("siglip-qwen2")
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"--model.hf={folder}", "--data.tasks=[\"sums\"]",
                           *(o.format(other=other) for o in overrides)], world_size=4)
    assert all(f in str(err.value) for f in fragments), str(err.value)


# the tensor-name layouts LLaVA folders come in: transformers 5.24's save_pretrained (as written), transformers 4's
# (the tower under vision_model.), and transformers 5's in-memory names
NAMINGS = {
    "transformers-4": [(r"^vision_tower\.", "vision_tower.vision_model.")],
    "transformers-5-in-memory": [(r"^language_model\.model\.", "model.language_model."),
                                 (r"^language_model\.lm_head\.", "lm_head."),
                                 (r"^vision_tower\.", "model.vision_tower."),
                                 (r"^multi_modal_projector\.", "model.multi_modal_projector.")],
}


@pytest.mark.parametrize("naming", list(NAMINGS))
def test_every_naming_of_a_llava_folder_loads_the_same_model(llava, tmp_path, naming):
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    _, folder = llava("clip-llama")
    shutil.copytree(folder, tmp_path / naming)
    renamed = {}
    for name, t in load_file(folder / "model.safetensors").items():
        for pattern, repl in NAMINGS[naming]:
            name = re.sub(pattern, repl, name)
        renamed[name] = t
    save_file(renamed, tmp_path / naming / "model.safetensors", metadata={"format": "pt"})
    want, got = build_pretrained(folder).state_dict(), build_pretrained(tmp_path / naming).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


def test_an_older_config_json_takes_transformers_defaults_for_what_it_leaves_out():
    """llava-hf/llava-1.5-7b-hf's config.json (transformers 4.36) names only what differs from LlamaConfig's and
    CLIPVisionConfig's defaults."""
    from loom.models.hf.llava import llava_configs

    hf = {"architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
          "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
          "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
                          "model_type": "llama", "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064},
          "tie_word_embeddings": False, "vision_config": {
              "hidden_size": 1024, "image_size": 336, "intermediate_size": 4096, "model_type": "clip_vision_model",
              "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
              "vocab_size": 32000},
          "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}
    lm, vision = llava_configs(hf, "llava-1.5-7b-hf", "")
    assert (lm.vocab_size, lm.hidden_size, lm.num_layers, lm.num_heads, lm.num_kv_heads, lm.intermediate_size,
            lm.rms_norm_eps, lm.tie_embeddings) == (32064, 4096, 32, 32, 32, 11008, 1e-5, False)
    assert (vision.num_layers, vision.position_grid, vision.patch_size, vision.act, vision.layer_norm_eps) == (
        23, 24, 14, "quick", 1e-5)
    assert vision.class_token and vision.drop_first_row and not vision.final_norm


def test_a_clip_tower_refuses_the_built_in_image_tasks_when_the_config_loads(llava):
    from loom.job import load_config
    from loom.typed_config import ConfigError

    _, folder = llava("clip-llama")
    with pytest.raises(ConfigError, match=r"data.tasks \['digits'\] draw images of assorted sizes.*16 × 16"):
        load_config(None, [f"--model.hf={folder}", "--data.tasks=[\"digits\"]"])
