"""Qwen2-VL folders (`model_type = "qwen2_vl"`): the tower with its merger and a Qwen2 LLM with M-RoPE in one folder
load into loom with transformers' logits, for several samples packed into one stream, each with its own number of
images of its own sizes."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from qwen2vl_folders import END_ID, IMAGE_ID, START_ID, write_qwen2_5_vl, write_qwen2vl  # noqa: E402

from loom.data.mrope import mrope_positions  # noqa: E402
from loom.data.spans import TokenSpans  # noqa: E402
from loom.models.hf import build_pretrained  # noqa: E402

TOL = 1e-5
# each sample's images (H, W pixels): two of different sizes, none, one, three
IMAGES = [[(28, 56), (56, 28)], [], [(140, 84)], [(28, 28), (84, 56), (28, 56)]]


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory):
    return write_qwen2vl(tmp_path_factory.mktemp("qwen2vl") / "folder")


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    return write_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl") / "folder")


def packed_samples(model, seed: int = 0):
    """Samples of text around each image as Qwen2-VL's template writes it: [(ids, images, grids)]."""
    g = torch.Generator().manual_seed(seed)
    tower = model.encoder("vision")
    out = []
    for k, sizes in enumerate(IMAGES):
        images = [torch.randn(3, h, w, generator=g) for h, w in sizes]
        ids = torch.randint(10, 290, (3 + k,), generator=g).tolist()
        for image in images:
            ids += [START_ID] + [IMAGE_ID] * tower.num_tokens(image) + [END_ID]
            ids += torch.randint(10, 290, (2,), generator=g).tolist()
        out.append((ids, images, [tower.encoder.grid(im) for im in images]))
    return out


def hf_logits(ref, samples) -> torch.Tensor:
    from transformers import Qwen2VLImageProcessorPil

    flatten = Qwen2VLImageProcessorPil(do_resize=False, do_rescale=False, do_normalize=False)
    logits = []
    with torch.no_grad():
        for ids, images, _ in samples:
            x = torch.tensor(ids)[None]
            extra = {}
            if images:
                pixels = flatten(images=images, return_tensors="pt")
                extra = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
            # mm_token_type_ids: which tokens are an image's (transformers 5's processor returns them)
            logits.append(ref(input_ids=x, mm_token_type_ids=(x == IMAGE_ID).int(), **extra).logits[0])
    return torch.cat(logits)


@pytest.mark.parametrize("name", ["qwen2vl", "qwen2_5_vl"])
def test_a_qwen2vl_folder_gives_transformers_logits_for_packed_samples(request, name):
    """Qwen2-VL's, and Qwen2.5-VL's (its windowed tower: the third sample's image, 5 × 3 merged tokens, spans two
    112-pixel windows)."""
    ref, folder = request.getfixturevalue(name)
    model = build_pretrained(folder).eval()
    assert model.placeholder_ids["vision"] == IMAGE_ID
    assert model.language.cfg.rope_scaling == {"rope_type": "mrope", "mrope_section": [2, 3, 3]}
    samples = packed_samples(model)
    ids = torch.cat([torch.tensor(x) for x, _, _ in samples])
    positions = torch.cat([torch.tensor(mrope_positions(x, IMAGE_ID, grids)) for x, _, grids in samples])
    with torch.no_grad():
        got = model(ids, positions, TokenSpans.from_lengths([len(x) for x, _, _ in samples]),
                    {"vision": [im for _, images, _ in samples for im in images]})
    want = hf_logits(ref, samples)
    assert want.abs().max() > 1.0
    assert (got - want).abs().max() <= TOL


def test_generation_continues_mrope_positions_after_each_prompts_images(qwen2vl):
    """Greedy KV-cached decoding of a Qwen2-VL model: each generated token's logprob equals the one a whole forward
    of prompt + answer gives it (positions after an image go on from its largest + 1, not from the token count)."""
    from loom.data.sample import Sample
    from loom.models.sampler import Sampler, SamplingParams

    _, folder = qwen2vl
    model = build_pretrained(folder).eval()
    samples = packed_samples(model, seed=1)
    prompts = [Sample(ids, [False] * len(ids), images, []) for ids, images, _ in samples]
    out = Sampler(model, eos_id=-1, pad_id=0, backend="sdpa").generate(prompts, SamplingParams(6, 0.0),
                                                                      torch.Generator())
    for (ids, images, grids), completion in zip(samples, out):
        whole = ids + completion.tokens
        positions = torch.tensor(mrope_positions(whole, IMAGE_ID, grids))
        with torch.no_grad():
            logits = model(torch.tensor(whole), positions, TokenSpans.from_lengths([len(whole)]), {"vision": images})
        logp = torch.log_softmax(logits[len(ids) - 1:-1], -1)
        want = logp.gather(-1, torch.tensor(completion.tokens)[:, None])[:, 0]
        assert (torch.tensor(completion.logprobs) - want).abs().max() <= TOL


def _flat_transformers4_config(hf: dict) -> dict:
    """config.json as transformers 4 wrote Qwen2-VL's: the text keys at the top level, rope_scaling of type mrope."""
    text = dict(hf.pop("text_config"))
    rope = text.pop("rope_parameters")
    flat = {k: v for k, v in text.items() if k not in ("model_type", "layer_types")}
    vision = dict(hf.pop("vision_config"), in_chans=3)
    vision.pop("in_channels")
    # as Qwen2-VL-2B-Instruct's: a sliding window set but off, the tower's act left to its default
    vision.pop("hidden_act")
    flat.update(sliding_window=32768, use_sliding_window=False, max_window_layers=28)
    return dict(hf, **flat, vision_config=vision, rope_theta=rope["rope_theta"],
                rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})


def test_an_older_flat_config_json_loads_the_same_model(qwen2vl, tmp_path):
    import dataclasses
    import json
    import shutil

    _, folder = qwen2vl
    shutil.copytree(folder, tmp_path / "old")
    hf = json.loads((folder / "config.json").read_text())
    (tmp_path / "old" / "config.json").write_text(json.dumps(_flat_transformers4_config(hf)))
    new, old = build_pretrained(folder), build_pretrained(tmp_path / "old")
    same = lambda a, b: dataclasses.replace(a, hf="") == dataclasses.replace(b, hf="")  # noqa: E731
    assert same(new.language.cfg, old.language.cfg) and same(new.vision.encoder.cfg, old.vision.encoder.cfg)
    assert all(torch.equal(a, b) for a, b in zip(new.state_dict().values(), old.state_dict().values()))


@pytest.mark.parametrize("change,fragments", [
    (lambda hf, files: files.__setitem__("drop", "visual.blocks.1.attn.qkv.weight"),
     ["missing tensors", "visual.blocks.1.attn.qkv.weight"]),
    (lambda hf, files: hf["vision_config"].__setitem__("hidden_act", "silu"),
     ["vision_config", "hidden_act = 'silu'"]),
    (lambda hf, files: hf["text_config"]["rope_parameters"].pop("mrope_section"),
     ["text_config", "mrope_section"]),
], ids=["missing-tensor", "tower-act", "no-mrope"])
def test_a_qwen2vl_folder_loom_cannot_load_is_named(qwen2vl, tmp_path, change, fragments):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from loom.models.hf import HFError

    _, folder = qwen2vl
    shutil.copytree(folder, tmp_path / "bad")
    hf, files = json.loads((folder / "config.json").read_text()), {}
    change(hf, files)
    (tmp_path / "bad" / "config.json").write_text(json.dumps(hf))
    if "drop" in files:
        tensors = load_file(folder / "model.safetensors")
        del tensors[files["drop"]]
        save_file(tensors, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(HFError) as err:
        build_pretrained(tmp_path / "bad")
    assert all(f in str(err.value) for f in (str(tmp_path / "bad"), *fragments)), str(err.value)
