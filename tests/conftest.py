"""Shared tiny fixtures: model configs small enough for a 2-core CPU, and random multimodal samples.

Samples are built by hand here (not through loom.data.format) so the tests of packing and attention do
not depend on the code that turns task examples into tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from loom.data.sample import Sample
from loom.data.tokenizer import ByteTokenizer
from loom.models.audio import AudioConfig
from loom.models.llm import LLMConfig
from loom.models.multimodal import MultimodalModel, build_model
from loom.models.vision import VisionConfig

PATCH = 4
N_MELS = 16


def tiny_llm_config() -> LLMConfig:
    return LLMConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=264)


def tiny_vision_config() -> VisionConfig:
    return VisionConfig(
        patch_size=PATCH, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64, position_grid=4
    )


def tiny_audio_config() -> AudioConfig:
    return AudioConfig(num_features=N_MELS, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
                       max_positions=64)


# the same tiny model as dotted overrides, for load_config / Trainer / the CLI
TINY_MODEL_OVERRIDES = [
    "--model.language.hidden_size=32",
    "--model.language.num_layers=2",
    "--model.language.num_heads=4",
    "--model.language.num_kv_heads=2",
    "--model.language.intermediate_size=64",
    "--model.language.vocab_size=264",
    f"--model.vision.patch_size={PATCH}",
    "--model.vision.hidden_size=32",
    "--model.vision.num_layers=1",
    "--model.vision.num_heads=4",
    "--model.vision.intermediate_size=64",
    "--model.vision.position_grid=4",
    f"--model.audio.num_features={N_MELS}",
    "--model.audio.hidden_size=32",
    "--model.audio.num_layers=1",
    "--model.audio.num_heads=4",
    "--model.audio.intermediate_size=64",
    "--model.audio.max_positions=64",
]


def tiny_job_overrides(out_dir: str | Path, *extra: str) -> list[str]:
    """Overrides for a quick tiny training job writing into `out_dir`."""
    return [
        *TINY_MODEL_OVERRIDES,
        "--data.train_size=64",
        "--data.heldout_size=3",
        "--train.global_batch_size=4",
        "--train.steps=5",
        "--train.warmup_steps=2",
        "--train.eval_max_new_tokens=2",
        "--train.device=cpu",
        "--run.tensorboard=false",
        "--run.progress=false",
        f"--run.out_dir={out_dir}",
        *extra,
    ]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture
def tok() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture
def tiny_model(tok) -> MultimodalModel:
    torch.manual_seed(0)
    model = build_model(tiny_llm_config(), tiny_vision_config(), tiny_audio_config(), tok.placeholder_ids)
    return model.eval()


def sharpen(model: torch.nn.Module, std: float = 0.25, seed: int = 0) -> torch.nn.Module:
    """Re-draws every weight matrix with a larger std so attention patterns are far from uniform; a wrong
    mask or position then moves the logits by much more than the test tolerance."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


@dataclass
class Spec:
    """One sample to build: image sizes (H, W), audio clip frame counts, text lengths."""

    images: list[tuple[int, int]] = field(default_factory=list)
    audio: list[int] = field(default_factory=list)
    prompt_len: int = 3
    answer_len: int = 4  # answer bytes; <eos> follows, so answer_len + 1 supervised tokens
    bos: bool = True
    eos: bool = True


def make_sample(spec: Spec, model: MultimodalModel, tok: ByteTokenizer, g: torch.Generator | None = None) -> Sample:
    """tokens: [<bos>] + placeholders for each image then each clip + prompt bytes + answer bytes + <eos>;
    the number of placeholders per item is what the model's encoder emits for it."""
    images = [torch.randn(3, h, w, generator=g) for h, w in spec.images]
    audio = [torch.randn(N_MELS, n, generator=g) for n in spec.audio]
    prompt = [tok.bos_id] if spec.bos else []
    for img in images:
        prompt += [tok.placeholder_ids["vision"]] * model.encoder("vision").num_tokens(img)
    for clip in audio:
        prompt += [tok.placeholder_ids["audio"]] * model.encoder("audio").num_tokens(clip)
    prompt += torch.randint(0, 256, (spec.prompt_len,), generator=g).tolist()
    answer = torch.randint(0, 256, (spec.answer_len,), generator=g).tolist() + ([tok.eos_id] if spec.eos else [])
    return Sample(prompt + answer, [False] * len(prompt) + [True] * len(answer), images, audio, task="random")


# a mix with images of different sizes (all patch multiples, not square), clips of different lengths,
# a text-only sample and a very short one
MIXED_SPECS = [
    Spec(images=[(8, 12)], prompt_len=2, answer_len=3),
    Spec(audio=[9], prompt_len=4, answer_len=3),
    Spec(prompt_len=8, answer_len=6),
    Spec(images=[(16, 4), (4, 8)], audio=[14], prompt_len=1, answer_len=4),
    Spec(prompt_len=0, answer_len=0, eos=False),  # just <bos>: a sample of length 1
    Spec(images=[(12, 12)], audio=[5], prompt_len=3, answer_len=1),
]


@pytest.fixture
def mixed_samples(tiny_model, tok) -> list[Sample]:
    g = torch.Generator().manual_seed(7)
    return [make_sample(s, tiny_model, tok, g) for s in MIXED_SPECS]


def text_sample(tokens: list[int], n_prompt: int) -> Sample:
    """A text-only sample whose first `n_prompt` tokens are the prompt."""
    return Sample(list(tokens), [False] * n_prompt + [True] * (len(tokens) - n_prompt), [], [])


@pytest.fixture(scope="session")
def worlds():
    """Spawned gloo worlds, reused across tests: `worlds.run(n_ranks, module_level_fn, *args)`."""
    from harness import WorldPool

    pool = WorldPool()
    yield pool
    pool.close()


def saved_tensors(checkpoint) -> tuple[dict[str, torch.Tensor], set[str]]:
    """A sharded checkpoint folder's weights, whole, by one-process name, and the names of its optimizer
    tensors (`<param>.<exp_avg|exp_avg_sq|step>`), read through loom's own checkpoint reader."""
    from loom.checkpoint.read import CheckpointWeights
    from loom.checkpoint.sharded import OPTIM, saved_metadata

    weights = CheckpointWeights(checkpoint)
    moments = {k[len(OPTIM):] for k in saved_metadata(checkpoint) if k.startswith(OPTIM)}
    return {n: weights.get(n) for n in weights.names}, moments


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_chat_tokenizer(root: Path) -> Path:
    """A small byte-level BPE tokenizer folder trained here, with ChatML specials and a chat template."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is this? A cat. A dog sits on a mat.", "user assistant system"] * 20, trainer)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return root


def write_user_data(root: Path, n: int = 32, seed: int = 0) -> Path:
    """A user's JSONL of `n` conversations beside their files: PNG images of a few sizes (whole 4-pixel patches
    or not), WAV clips at 8, 16 and 44.1 kHz, some conversations with both, some with two turns. Returns the
    JSONL's path (`root/data.jsonl`; files under `root/media/`)."""
    import json

    import numpy as np
    import soundfile
    from PIL import Image

    rng = np.random.default_rng(seed)
    media = root / "media"
    media.mkdir(parents=True, exist_ok=True)
    colours = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
    pitches = {"low": 300.0, "high": 2000.0}
    lines = []
    for i in range(n):
        colour = list(colours)[i % 3]
        h, w = (int(x) for x in rng.integers(6, 20, size=2))
        pixels = np.clip(np.array(colours[colour]) + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(media / f"{i}.png")
        pitch, rate = list(pitches)[i % 2], (8000, 16000, 44100)[i % 3]
        t = np.arange(int(rate * rng.uniform(0.05, 0.2))) / rate
        soundfile.write(media / f"{i}.wav", (0.3 * np.sin(2 * np.pi * pitches[pitch] * t)).astype(np.float32), rate)
        user = [{"type": "image", "path": f"media/{i}.png"}, {"type": "text", "text": "What colour is this?"}]
        answer = colour
        if i % 4 == 1:  # image and clip
            user.append({"type": "audio", "path": f"media/{i}.wav"})
            answer = f"{colour}, {pitch}"
        if i % 4 == 2:  # a clip alone
            user = [{"type": "audio", "path": f"media/{i}.wav"}, {"type": "text", "text": "Low or high?"}]
            answer = pitch
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        if i % 4 == 3:  # two turns: both answers are targets
            messages += [{"role": "user", "content": "Sure?"}, {"role": "assistant", "content": f"Yes, {colour}."}]
        lines.append(json.dumps({"messages": messages}))
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    return root / "data.jsonl"


def user_data_overrides(root: Path, *extra: str) -> list[str]:
    """The tiny model trained on `write_user_data(root / "data")` with `tiny_chat_tokenizer(root / "tok")`."""
    jsonl = root / "data" / "data.jsonl"
    if not jsonl.is_file():
        write_user_data(root / "data")
    if not (root / "tok" / "tokenizer.json").is_file():
        (root / "tok").mkdir(exist_ok=True)
        tiny_chat_tokenizer(root / "tok")
    return [f"--model.tokenizer={root / 'tok'}", f'--data.sources=[{{path = "{jsonl}", weight = 1.0}}]',
            "--data.heldout_size=4", *extra]


def exported_bit_for_bit(folder: Path, out: Path):
    """loom's export of a Hugging Face folder's module, checked to write the folder's tensors bit for bit;
    transformers' model read back from it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from loom.models.hf import build_pretrained, export_module

    export_module(build_pretrained(folder), out)
    original, exported = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    return AutoModelForCausalLM.from_pretrained(out)


def saved_far_from_init(model: torch.nn.Module, folder: Path):
    """`model` (a transformers model) with every weight redrawn far from its init — matrices N(0, 0.15²), vectors
    around 1, routers' selection biases N(0, 0.1²) — so every tensor changes the logits, saved to `folder` with
    `save_pretrained`; (model, folder)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise * 0.15 if p.ndim >= 2 else 1 + noise * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="session")
def llava(tmp_path_factory):
    """name of tests/llava_folders.py's FOLDERS → (transformers' LlavaForConditionalGeneration far from its init,
    its save_pretrained folder with a preprocessor_config.json); each written once per session."""
    from llava_folders import write_llava

    root, made = tmp_path_factory.mktemp("llava"), {}

    def get(name: str):
        if name not in made:
            made[name] = write_llava(name, root / name)
        return made[name]

    return get


@pytest.fixture(scope="session")
def llava_onevision(tmp_path_factory):
    """name of tests/llava_onevision_folders.py's FOLDERS → (transformers' model far from its init, its folder);
    each written once per session."""
    from llava_onevision_folders import write_llava_onevision

    root, made = tmp_path_factory.mktemp("llava_onevision"), {}

    def get(name: str = "ov"):
        if name not in made:
            made[name] = write_llava_onevision(name, root / name)
        return made[name]

    return get


def assert_logits_equal_transformers(ref: torch.nn.Module, lm: torch.nn.Module, vocab: int, tol: float = 1e-5):
    """loom's DecoderLM `lm` gives transformers' `ref` logits within `tol`: on a padded batch of 2 × 24, and on 3
    samples packed into one stream (positions restart, attention stays inside each) against each alone."""
    from loom.data.spans import TokenSpans

    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        got = lm(ids, torch.arange(24).expand(2, 24), TokenSpans())
    assert want.abs().max() > 1.0
    assert (got - want).abs().max() <= tol
    lengths = [7, 13, 4]
    samples = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    with torch.no_grad():
        got = lm(torch.cat(samples), torch.cat([torch.arange(n) for n in lengths]), TokenSpans.from_lengths(lengths))
        want = torch.cat([ref(s[None]).logits[0] for s in samples])
    assert (got - want).abs().max() <= tol
