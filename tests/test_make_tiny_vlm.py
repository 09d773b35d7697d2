"""examples/make_tiny_vlm.py: the folders and files it writes are what loom's user-data path reads — HF model
folders loom (and transformers, when installed) loads, a chat tokenizer whose targets are exactly the answers,
media in whole patches and at 16 kHz, held-out media apart from training's, the same bytes for the same seed."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from loom.data.chat import PLACEHOLDERS, ChatTokenizer
from loom.data.conversation_format import MediaRules, conversation_sample
from loom.data.conversations import ConversationFile
from loom.data.images import ImageRule
from loom.data.sample import decoded
from loom.models.audio import AudioConfig, AudioEncoder
from loom.models.hf.load import config_from_folder, load_module
from loom.models.llm import DecoderLM
from loom.models.vision import VisionEncoder
from readme_figures import short_form_band

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "make_tiny_vlm.py"
ARGS = ["--train", "12", "--heldout", "6", "--seed", "3"]


def _script():
    # examples/ is not a package: load the file as a module, as `python examples/make_tiny_vlm.py` runs it
    spec = importlib.util.spec_from_file_location("make_tiny_vlm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny_vlm")
    _script().main([str(root), *ARGS])
    return root


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_writes_every_folder_and_one_conversation_per_item(out):
    for name in ("llm/config.json", "llm/model.safetensors", "vision/config.json", "vision/model.safetensors",
                 "vision/preprocessor_config.json", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"):
        assert (out / name).is_file(), name
    train, held = _lines(out / "data" / "train.jsonl"), _lines(out / "data" / "heldout.jsonl")
    assert len(train) == 12 and len(held) == 6
    kinds = [line["messages"][0]["content"][0]["type"] for line in train]
    assert kinds == ["image", "image", "audio"] * 4  # digits, shapes, tones in turn, as TaskDataset orders them
    assert len(list((out / "data" / "img").glob("*.png"))) == 8 + 4
    assert len(list((out / "data" / "wav").glob("*.wav"))) == 4 + 2


def test_the_same_seed_writes_the_same_bytes(out, tmp_path):
    _script().main([str(tmp_path), *ARGS])
    assert _files(tmp_path) == _files(out)


def test_model_folders_read_back_as_a_qwen2_and_a_siglip_sized_by_the_tokenizer(out):
    lm, vis = config_from_folder(out / "llm", expect="language"), config_from_folder(out / "vision", expect="vision")
    assert json.loads((out / "llm" / "config.json").read_text())["model_type"] == "qwen2"
    assert lm.attention_bias and lm.tie_embeddings and (lm.hidden_size, lm.num_layers) == (128, 4)
    chat = ChatTokenizer(out / "tokenizer")
    # loom adds the placeholders and grows the embedding itself: the folder's vocabulary lacks them
    assert chat.added == list(PLACEHOLDERS.values()) and lm.vocab_size == chat.vocab_size - 2
    assert 400 <= lm.vocab_size <= 1000
    pre = json.loads((out / "vision" / "preprocessor_config.json").read_text())
    assert vis.patch_size == pre["patch_size"] == 8 and vis.position_grid == 6
    assert ImageRule.of(8, 64, 48 * 48, out / "vision").mean == tuple(pre["image_mean"])

    with torch.device("meta"):
        llm, vision = DecoderLM(lm), VisionEncoder(vis)
    for folder, module in ((out / "llm", llm), (out / "vision", vision)):
        report = load_module(folder, module)
        assert not report.skipped and all(torch.isfinite(p).all() for p in module.parameters())
    assert llm.lm_head.weight is llm.embed_tokens.weight
    assert 0.015 < llm.embed_tokens.weight.std() < 0.025  # the LLM's N(0, init_std) draw, not torch's N(0, 1)


def test_every_conversation_tokenises_with_targets_exactly_on_the_answer(out):
    chat = ChatTokenizer(out / "tokenizer")
    with torch.device("meta"):  # the counters read only the configs
        vision = VisionEncoder(config_from_folder(out / "vision"))
        audio = AudioEncoder(AudioConfig(num_features=16, hidden_size=32, num_layers=1, num_heads=4,
                                         intermediate_size=64))
    p, grid = vision.cfg.patch_size, vision.cfg.position_grid
    rules = MediaRules(ImageRule.of(p, p * p, (grid * p) ** 2, out / "vision"), n_mels=16)
    counters = {"vision": vision.num_tokens, "audio": audio.num_tokens}
    for split in ("train", "heldout"):
        data = ConversationFile(out / "data" / f"{split}.jsonl")
        lines = _lines(data.path)
        for i in range(len(data)):
            conv = data[i]
            s = conversation_sample(conv, chat, rules, counters)
            said = chat.tokenizer.decode([t for t, y in zip(s.tokens, s.supervised) if y], skip_special_tokens=False)
            answer = lines[i]["messages"][1]["content"][0]["text"]
            # the end-of-turn token is the model's to say; the newline after it is not
            assert said == answer + "<|im_end|>", conv.where
            for image, path in zip(s.images, conv.media("image")):
                with Image.open(path) as png:
                    assert png.mode == "RGB" and (png.height % p, png.width % p) == (0, 0)
                    assert image.shape == (3, png.height, png.width)  # whole patches within bounds: not resized
                    assert min(png.size) >= 2 * p
            assert all(torch.isfinite(decoded(x)).all() for x in (*s.images, *s.audio))


def test_wavs_are_16_khz_pcm_and_heldout_media_are_not_training_media(out):
    import soundfile

    for wav in (out / "data" / "wav").glob("*.wav"):
        info = soundfile.info(str(wav))
        assert (info.samplerate, info.channels, info.subtype) == (16_000, 1, "PCM_16")
        assert 0.1 <= info.duration < 0.6  # 1-3 tones of 80-140 ms, 20-50 ms gaps, 10-20 ms edges
    media = {split: {hashlib.sha256(p.read_bytes()).hexdigest() for p in (out / "data").glob(f"*/{split}-*")}
             for split in ("train", "heldout")}
    assert len(media["heldout"]) == 6 and not media["train"] & media["heldout"]


def test_transformers_loads_the_folders_with_loom_s_outputs(out):
    transformers = pytest.importorskip("transformers")
    from loom.data.spans import TokenSpans
    from loom.models.hf.load import build_pretrained

    ids = torch.randint(0, 400, (1, 16), generator=torch.Generator().manual_seed(0))
    images = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = transformers.Qwen2ForCausalLM.from_pretrained(out / "llm").eval()(ids).logits
        ours = build_pretrained(out / "llm").eval()(ids, torch.arange(16)[None], TokenSpans())
        assert (ref - ours).abs().max() <= 1e-5
        ref = transformers.SiglipVisionModel.from_pretrained(out / "vision").eval()(images).last_hidden_state
        ours = build_pretrained(out / "vision").eval()(list(images))
        assert (ref.flatten(0, 1) - ours).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    """docs/data.md's example as a user makes it (`python examples/make_tiny_vlm.py runs/tiny_vlm`), but for 6 held-out
    conversations instead of 120: the same first 6 (item i is example i // 3 of task i % 3), and the tokenizer,
    the weights and train.jsonl do not depend on --heldout, so no training step changes."""
    root = tmp_path_factory.mktemp("example")
    _script().main([str(root), "--heldout", "6"])
    return root


def test_examples_jsonl_toml_trains_on_the_folders_under_its_layout(example, tmp_path, capsys):
    """CI's short form of `loom train examples/jsonl.toml` (docs/training.md's: the run's first steps, on the
    example's own folders): its 4-rank heterogeneous layout, the held-out evaluation per task (the lines' "task"), the
    launcher's generation on the checkpoint, and the loss at the last step inside the docs' band."""
    import loom.cli

    steps, low, high = short_form_band("loom train examples/jsonl.toml")
    config = SCRIPT.parent / "jsonl.toml"
    run, out = tmp_path / "run", example
    code = loom.cli.main([
        "train", str(config), f"--model.tokenizer={out / 'tokenizer'}", f"--model.language.hf={out / 'llm'}",
        f"--model.vision.hf={out / 'vision'}", f"--data.heldout={out / 'data' / 'heldout.jsonl'}",
        f'--data.sources=[{{path = "{out / "data" / "train.jsonl"}", weight = 1.0}}]',
        f"--train.steps={steps}", f"--run.out_dir={run}", "--run.tensorboard=false",
        "--run.progress=false", "--train.eval_max_new_tokens=3"])
    assert code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert low <= train[-1]["loss"] <= high, f"loss at step {steps}: {train[-1]['loss']:.4f}, docs: {low}–{high}"
    heldout = [r for r in records if r["kind"] == "heldout"]
    assert len(heldout) == 1 and {"token_accuracy/digits", "token_accuracy/tones"} <= heldout[0].keys()
    printed = capsys.readouterr().out
    assert "exact match" in printed and "chance" in printed  # the tasks' names carry their chance level
