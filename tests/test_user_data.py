"""Training on a user's own data (issue 17): JSONL conversations with image and audio files through an HF
tokenizer's chat template. Every layout trains on the same samples as the one-process reference (verify on
this data), and bad input — a malformed line, a missing or undecodable file, a sample over the token budget,
a placeholder typed into the text — stops the run naming file:line on every rank alike, or is skipped, counted
and listed, the same on every rank."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import tiny_job_overrides, user_data_overrides, write_user_data
from oracle import assert_all_passed, run_verify

from loom.config import ConfigError
from loom.job import load_config
from loom.data.conversations import BadSample


def _trainer(tmp_path, *extra: str):
    from loom.train.trainer import Trainer

    return Trainer(load_config(None, tiny_job_overrides(tmp_path / "run", *user_data_overrides(tmp_path, *extra))))


def _lines(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "data" / "data.jsonl").read_text().splitlines()]


def _rewrite(tmp_path, lines: list) -> None:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    (tmp_path / "data" / "data.jsonl").write_text(text)


# ---------------------------------------------------------------- the same samples under every layout

LAYOUTS = {
    # 4 ranks colocated: vision dp4 → LLM tp2·dp2 (fan-in), audio tp2·dp2; packed into bins of T tokens
    "heterogeneous": (4, ["--layout.language.tp=2", "--layout.audio.tp=2", "--train.microbatches=2",
                          "--data.tokens_per_microbatch=176"]),
    # non-colocated: the encoders on rank 0, the LLM dp2 on ranks 1-2
    "non-colocated": (3, ["--layout.vision.ranks=0", "--layout.audio.ranks=0", "--layout.language.ranks=1-2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_layout_trains_on_user_data_as_one_process_does(name, worlds, tmp_path_factory):
    size, overrides = LAYOUTS[name]
    root = tmp_path_factory.mktemp("user")
    user = user_data_overrides(root)  # written once, here, before the ranks read it
    results = worlds.run(size, run_verify, [*user, "--train.global_batch_size=8", *overrides], timeout=240)
    assert_all_passed(name, results, steps=3)


# ---------------------------------------------------------------- the tokenizer's vocabulary


def test_the_vocabulary_grows_for_the_placeholders_and_keeps_the_pretrained_rows(tmp_path):
    from loom.models.hf.export import export_module
    from loom.models.llm import DecoderLM
    from loom.data.chat import ChatTokenizer
    from conftest import tiny_chat_tokenizer, tiny_llm_config
    import dataclasses

    (tmp_path / "tok").mkdir()
    base = ChatTokenizer(tiny_chat_tokenizer(tmp_path / "tok")).tokenizer.get_vocab_size(with_added_tokens=False)
    llm = DecoderLM(dataclasses.replace(tiny_llm_config(), vocab_size=base, tie_embeddings=False))
    export_module(llm, tmp_path / "llm")
    t = _trainer(tmp_path, f"--model.language.hf={tmp_path / 'llm'}")
    lm = t.model.language
    assert t.tok.vocab_size == base + 2 and lm.embed_tokens.weight.shape[0] == t.cfg.model.language.vocab_size == 320
    for name in ("embed_tokens", "lm_head"):
        got, pretrained = getattr(lm, name).weight.detach(), getattr(llm, name).weight.detach()
        assert torch.equal(got[:base], pretrained)  # the folder's rows, as they were
        assert got[base:].std() > 0  # the new rows drawn, not zeros


# ---------------------------------------------------------------- bad input


def test_a_bad_line_stops_the_run_before_any_weight_is_read(tmp_path, monkeypatch):
    write_user_data(tmp_path / "data")
    lines = _lines(tmp_path)
    lines[3] = {"messages": [{"role": "robot", "content": "hi"}]}
    lines[5] = '{"messages": ['
    _rewrite(tmp_path, lines)
    import loom.train.build as build

    monkeypatch.setattr(build, "initial_weights", lambda *a, **k: pytest.fail("weights read before the data check"))
    where = tmp_path / "data" / "data.jsonl"
    with pytest.raises(BadSample, match=rf"2 bad conversations(.|\n)*{where}:4: messages\[0\]: unknown role 'robot'"
                                        rf"(.|\n)*{where}:6: not valid JSON(.|\n)*on_bad_sample = \"skip\""):
        _trainer(tmp_path)


def test_skipped_lines_and_files_are_counted_and_listed(tmp_path):
    write_user_data(tmp_path / "data")
    lines = _lines(tmp_path)
    lines[2]["messages"][0]["content"][0]["path"] = "media/missing.wav"  # found by the line check
    (tmp_path / "data" / "media" / "7.png").write_bytes(b"not an image")  # found when its header is read
    _rewrite(tmp_path, lines)
    t = _trainer(tmp_path, "--data.on_bad_sample=skip", "--train.steps=8", "--data.heldout_size=1")
    t.run()
    listed = [json.loads(x) for x in (tmp_path / "run" / "bad_samples.jsonl").read_text().splitlines()]
    where = str(tmp_path / "data" / "data.jsonl")
    assert [x["where"] for x in listed] == [f"{where}:3", f"{where}:8"]
    assert "missing.wav" in listed[0]["why"] and "cannot read image" in listed[1]["why"]
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["bad_samples"] for x in logged if "bad_samples" in x][-1] == 2


def _truncate(png) -> None:
    """Keeps the header (size readable) but cuts the pixel data: found only by whoever decodes it."""
    data = png.read_bytes()
    png.write_bytes(data[: len(data) // 2])


def test_a_file_that_fails_only_when_decoded_names_its_line(tmp_path):
    write_user_data(tmp_path / "data")
    for i in range(0, 32, 4):
        _truncate(tmp_path / "data" / "media" / f"{i}.png")
    with pytest.raises(BadSample, match=r"data\.jsonl:29: cannot decode image"):  # the held-out set decodes now
        _trainer(tmp_path)
    t = _trainer(tmp_path, "--data.on_bad_sample=skip", "--train.global_batch_size=16")
    assert list(t.data.bad.found) == [f"{tmp_path / 'data' / 'data.jsonl'}:29"]
    t.train_step()  # the training samples' images decode at the step: the truncated ones are skipped
    assert len(t.data.bad) > 1


def _no_weight_read(monkeypatch) -> None:
    import loom.train.build as build

    monkeypatch.setattr(build, "initial_weights", lambda *a, **k: pytest.fail("weights read before the data check"))


# what the line, the tokenizer and the model's config can judge is found by the prescan, before any weight
def test_a_sample_over_the_token_budget_names_its_line_before_any_weight_is_read(tmp_path, monkeypatch):
    _no_weight_read(monkeypatch)
    with pytest.raises(BadSample, match=r"data\.jsonl:\d+: \d+ tokens .* data\.tokens_per_microbatch = 24"):
        _trainer(tmp_path, "--data.tokens_per_microbatch=24")


def test_a_placeholder_typed_into_the_text_names_its_line_before_any_weight_is_read(tmp_path, monkeypatch):
    write_user_data(tmp_path / "data")
    lines = _lines(tmp_path)
    lines[0]["messages"][0]["content"][1]["text"] = "What is <|image_pad|>?"
    _rewrite(tmp_path, lines)
    _no_weight_read(monkeypatch)
    with pytest.raises(BadSample, match=r"1 bad conversations:\n  \S*data\.jsonl:1: more <\|image_pad\|> "
                                        r"placeholders than vision items"):
        _trainer(tmp_path, "--data.heldout_size=1")


def test_audio_for_a_model_without_an_audio_encoder_is_found_before_any_weight_is_read(tmp_path, monkeypatch):
    _no_weight_read(monkeypatch)
    with pytest.raises(BadSample, match=r"data\.jsonl:2: has audio items but the model has no audio encoder"):
        _trainer(tmp_path, '--model.encoders=["vision"]')


def test_a_clip_longer_than_the_audio_positions_is_found_before_any_weight_is_read(tmp_path, monkeypatch):
    _no_weight_read(monkeypatch)
    with pytest.raises(BadSample, match=r"data\.jsonl:\d+: clip 1 gives \d+ frames after subsampling, more than "
                                        r"model\.audio\.max_positions = 8"):
        _trainer(tmp_path, "--model.audio.max_positions=8")


def test_a_conversation_the_chat_template_refuses_names_its_line(tmp_path, monkeypatch):
    user_data_overrides(tmp_path)  # writes the data and the tokenizer folder
    config = tmp_path / "tok" / "tokenizer_config.json"
    refusing = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
    config.write_text(json.dumps({**json.loads(config.read_text()),
                                  "chat_template": refusing + json.loads(config.read_text())["chat_template"]}))
    lines = _lines(tmp_path)
    lines[6]["messages"].insert(0, {"role": "system", "content": "Be brief."})
    _rewrite(tmp_path, lines)
    _no_weight_read(monkeypatch)
    with pytest.raises(BadSample, match=r"data\.jsonl:7: the chat template refuses this conversation "
                                        r"\(chat template: no system turns\)"):
        _trainer(tmp_path)


def test_every_rank_stops_on_a_file_only_one_of_them_decodes(worlds, tmp_path_factory):
    """vision dp2 on 2 ranks: each decodes half the images; a truncated one is found by one rank, and both
    raise the same message (neither waits in a collective for the other)."""
    root = tmp_path_factory.mktemp("agree")
    user = _with_truncated_images(root)
    results = worlds.run(2, _train_two_steps, [*user, "--train.global_batch_size=8"], str(root / "run"), timeout=180)
    assert results[0] == results[1] and "cannot decode image" in results[0]


def test_every_rank_skips_a_file_only_one_of_them_decodes_as_one_process_does(worlds, tmp_path_factory):
    root = tmp_path_factory.mktemp("agree-skip")
    user = _with_truncated_images(root)
    results = worlds.run(2, run_verify, [*user, "--data.on_bad_sample=skip", "--train.global_batch_size=8"],
                         timeout=180)
    assert_all_passed("skip-undecodable", results, steps=3)


def _with_truncated_images(root) -> list[str]:
    """The tiny user data with every fourth training image truncated (the held-out ones intact)."""
    user = user_data_overrides(root, "--data.heldout_size=2")
    for i in range(0, 28, 4):
        _truncate(root / "data" / "media" / f"{i}.png")
    return user


def _train_two_steps(overrides: list[str], out: str) -> str:
    import torch.distributed as dist

    from loom.train.trainer import Trainer

    t = Trainer(load_config(None, tiny_job_overrides(out, *overrides), world_size=dist.get_world_size()))
    try:
        for _ in range(2):
            t.train_step()
    except BadSample as e:
        return str(e)
    return "trained"


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, message", [
    (["--data.sources=[{path = 'nowhere.jsonl'}]", "--model.tokenizer=x"], r"data\.sources\[0\]\.path = 'nowhere"),
    (["--data.sources=[{path = '{data}'}]"], r"data\.sources needs model\.tokenizer"),
    (["--data.sources=[{path = '{data}', weight = 0}]", "--model.tokenizer=x"], r"data\.sources\[0\]\.weight = 0"),
    (["--model.tokenizer=x"], r"model\.tokenizer = 'x' is the tokenizer of a user's data"),
    (["--data.sources=[{path = '{data}'}]", "--model.tokenizer=x", "--data.format=bshd"], r"data\.padded_length"),
])
def test_config_errors_name_the_key(tmp_path, overrides, message):
    data = write_user_data(tmp_path, n=2)
    with pytest.raises(ConfigError, match=message):
        load_config(None, [o.replace("{data}", str(data)) for o in overrides])


def test_a_tokenizer_folder_without_a_chat_template_is_a_config_error(tmp_path):
    (tmp_path / "tok").mkdir()
    from conftest import tiny_chat_tokenizer

    tiny_chat_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"model\.tokenizer = .*no chat template"):
        _trainer(tmp_path)


# ---------------------------------------------------------------- media headers


# frame counts whose resampled length is just past a whole hop (44.1 kHz: 4409 → 1599.6 samples at 16 kHz)
@pytest.mark.parametrize("rate, n", [(8000, 987), (16000, 800), (22050, 2204), (44100, 4409), (44100, 4410)])
def test_a_clip_header_predicts_its_decoded_shape(tmp_path, rate, n):
    import soundfile

    from loom.data.audio import audio_file

    soundfile.write(tmp_path / "a.wav", np.random.default_rng(0).normal(0, 0.1, n).astype(np.float32), rate)
    clip = audio_file(tmp_path / "a.wav", 80)
    assert tuple(clip.load().shape) == clip.shape


def test_an_image_header_predicts_its_decoded_shape(tmp_path):
    from PIL import Image

    from loom.data.images import ImageRule, image_file

    Image.fromarray(np.zeros((37, 53, 3), dtype=np.uint8)).save(tmp_path / "x.png")
    image = image_file(tmp_path / "x.png", ImageRule.of(4, 16, 1024))
    assert tuple(image.load().shape) == image.shape and image.shape[1] * image.shape[2] <= 1024
