"""A Qwen2-Audio folder's clips are prepared as Qwen2AudioProcessor prepares them — the log-mel of each clip padded
with silence to 30 s, its frames counted by the attention mask, the two frames after them kept for the tower's
convolutions — and a conversation's ids equal the processor's: its chat template's <|audio_bos|> <|AUDIO|>
<|audio_eos|> per clip, <|AUDIO|> repeated once per pooled row."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile

transformers = pytest.importorskip("transformers")
from conftest import tiny_chat_tokenizer  # noqa: E402
from vlm_jobs import example  # noqa: E402
from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor  # noqa: E402

from loom.data.audio import CONTEXT_FRAMES, audio_file  # noqa: E402
from loom.data.conversations import BadSample  # noqa: E402
from loom.models.qwen2_audio import pooled_rows  # noqa: E402

PADDED = 480_000  # 30 s at 16 kHz
# samples at 16 kHz: 3 frames (one token), whole frames and not, odd and even frame counts, exactly 30 s
LENGTHS = [480, 4_000, 19_745, 159_841, PADDED]


def wav_files(root, lengths: list[int]) -> list:
    """One WAV (32-bit float, 16 kHz) of noise and a tone per length, named by it."""
    rng = np.random.default_rng(0)
    paths = []
    for n in lengths:
        t = np.arange(n) / 16_000
        wave = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(n)
        paths.append(root / f"{n}.wav")
        soundfile.write(paths[-1], wave.astype(np.float32), 16_000, subtype="FLOAT")
    return paths


def test_clips_are_qwen2audio_processors_features_and_placeholder_counts(tmp_path):
    extractor = WhisperFeatureExtractor(feature_size=128)
    for path in wav_files(tmp_path, LENGTHS):
        wave = soundfile.read(path, dtype="float32")[0]
        want = extractor(wave, sampling_rate=16_000, padding="max_length", return_attention_mask=True,
                         return_tensors="np")
        frames = int(want["attention_mask"].sum())
        clip = audio_file(path, 128, padded_to=PADDED)
        got = clip.load().numpy()
        assert clip.shape == got.shape == (128, frames + CONTEXT_FRAMES), path.name
        past = np.pad(want["input_features"][0], ((0, 0), (0, CONTEXT_FRAMES)))  # zeros after 30 s
        assert np.abs(got - past[:, : frames + CONTEXT_FRAMES]).max() < 1e-4, path.name
        # the processor's count: its conv and pooling lengths of the mask's frames
        assert pooled_rows(frames) == (((frames - 1) // 2 + 1) - 2) // 2 + 1


def test_a_clip_over_30_s_or_too_short_for_a_row_is_a_bad_sample_naming_it(tmp_path):
    long, short = wav_files(tmp_path, [PADDED + 1, 320])
    with pytest.raises(BadSample, match=r"data.jsonl:3: audio '.*480001.wav' is 30.00 s, longer than the 30 s .*"
                                        r"n_samples = 480000"):
        audio_file(long, 128, "data.jsonl:3", padded_to=PADDED)
    with pytest.raises(BadSample, match="320 samples at 16 kHz: under 3 frames"):
        audio_file(short, 128, padded_to=PADDED)


def qwen2audio_processor(folder) -> Qwen2AudioProcessor:
    """examples/make_tiny_qwen2audio.py's processor (the audio tokens, WhisperFeatureExtractor at 128 mel bins, its
    default chat template) of a tiny ChatML tokenizer, saved into `folder` (as a released folder holds them)."""
    folder.mkdir(parents=True, exist_ok=True)
    tiny_chat_tokenizer(folder)
    return example("make_tiny_qwen2audio").save_processor(folder)


def test_a_qwen2audio_conversation_gives_qwen2audio_processors_ids(tmp_path):
    """Two turns, three clips of different lengths: loom's ids equal Qwen2AudioProcessor's apply_chat_template + its
    call on the same waveforms."""
    from loom.data.chat import ChatTokenizer
    from loom.data.conversations import parse_conversation
    from loom.models.audio import AudioConfig
    from loom.models.qwen2_audio import Qwen2AudioEncoder

    processor = qwen2audio_processor(tmp_path / "folder")
    paths = wav_files(tmp_path, LENGTHS[1:4])
    messages = [{"role": "user", "content": [{"type": "audio", "path": paths[0].name},
                                             {"type": "text", "text": "What is this?"},
                                             {"type": "audio", "path": paths[1].name}]},
                {"role": "assistant", "content": "A cat."},
                {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                             {"type": "audio", "path": paths[2].name}]},
                {"role": "assistant", "content": [{"type": "text", "text": "A dog."}]}]
    as_hf = [dict(m, content=m["content"] if isinstance(m["content"], list) else
                  [{"type": "text", "text": m["content"]}]) for m in messages]
    text = processor.apply_chat_template(as_hf, tokenize=False)
    waves = [soundfile.read(p, dtype="float32")[0] for p in paths]
    want = processor(text=text, audio=waves, return_tensors="pt")

    chat = ChatTokenizer(tmp_path / "folder", {"audio": "<|AUDIO|>"})
    assert chat.reads_parts and chat.added == []
    conv = parse_conversation(json.dumps({"messages": messages}), "data.jsonl:1", tmp_path)
    tower = Qwen2AudioEncoder(AudioConfig(family="qwen2_audio", num_features=128))
    ids, _ = chat.encode(conv, {"audio": [tower.num_tokens(audio_file(p, 128, padded_to=PADDED)) for p in paths]})
    assert ids == want["input_ids"][0].tolist()
    frames = want["feature_attention_mask"].sum(-1).tolist()
    assert sum(i == chat.placeholder_ids["audio"] for i in ids) == sum(map(pooled_rows, frames)) > 3


def test_a_processor_config_loom_cannot_follow_is_named_with_its_key(tmp_path):
    from loom.data.audio import processor_samples

    with pytest.raises(ValueError, match=r"preprocessor_config.json is missing"):
        processor_samples(tmp_path, 128)
    WhisperFeatureExtractor(feature_size=80, hop_length=200).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        processor_samples(tmp_path, 128)
    assert all(f in str(err.value) for f in ("preprocessor_config.json", "feature_size = 80 (loom's features: 128)",
                                             "hop_length = 200 (loom's features: 160)")), str(err.value)
    WhisperFeatureExtractor(feature_size=128).save_pretrained(tmp_path)
    assert processor_samples(tmp_path, 128) == PADDED
