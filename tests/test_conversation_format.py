"""A JSONL conversation with an image and a clip → a Sample the model reads (loom/data/conversation_format.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import tiny_audio_config, tiny_chat_tokenizer, tiny_vision_config
from PIL import Image

from loom.data.chat import ChatTokenizer
from loom.data.conversation_format import MediaRules, conversation_sample
from loom.data.conversations import BadSample, ConversationFile
from loom.data.images import ImageRule
from loom.models.audio import AudioEncoder
from loom.models.vision import VisionEncoder


def test_a_conversation_becomes_a_sample_sized_by_its_encoders(tmp_path):
    import soundfile

    Image.fromarray(np.full((24, 40, 3), 128, dtype=np.uint8)).save(tmp_path / "x.png")
    soundfile.write(tmp_path / "a.wav", np.zeros(8000, dtype=np.float32), 16_000)
    line = {"messages": [{"role": "user", "content": [{"type": "image", "path": "x.png"},
                                                      {"type": "audio", "path": "a.wav"},
                                                      {"type": "text", "text": "What is this?"}]},
                         {"role": "assistant", "content": "A cat."}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(line) + "\n" + json.dumps({"messages": line["messages"][:1]}))
    data = ConversationFile(tmp_path / "d.jsonl")
    chat = ChatTokenizer(tiny_chat_tokenizer(tmp_path))
    vision, audio = VisionEncoder(tiny_vision_config()), AudioEncoder(tiny_audio_config())
    counters = {"vision": vision.num_tokens, "audio": audio.num_tokens}
    rules = MediaRules(ImageRule.of(4, 16, 32 * 32), n_mels=audio.cfg.num_features)
    s = conversation_sample(data[0], chat, rules, counters, task="d")
    assert s.images[0].shape == (3, 24, 40)  # whole 4-pixel patches already, 960 pixels within [16, 1024]
    assert s.audio[0].shape == (audio.cfg.num_features, 50)  # 0.5 s: 50 frames of 10 ms
    assert s.tokens.count(chat.placeholder_ids["vision"]) == vision.num_tokens(s.images[0]) == 60
    assert s.tokens.count(chat.placeholder_ids["audio"]) == audio.num_tokens(s.audio[0]) == 25
    said = chat.tokenizer.decode([t for t, y in zip(s.tokens, s.supervised) if y], skip_special_tokens=False)
    assert said == "A cat.<|im_end|>" and s.task == "d"
    with pytest.raises(BadSample, match=r"d\.jsonl:2: no assistant turn"):
        data[1]
    (tmp_path / "t.jsonl").write_text(json.dumps({"task": "cats", **line}))
    conversation = ConversationFile(tmp_path / "t.jsonl")[0]
    assert conversation_sample(conversation, chat, rules, counters, task="t").task == "cats"

    with pytest.raises(BadSample, match=r"d\.jsonl:1: has audio items but the model has no audio encoder"):
        conversation_sample(data[0], chat, rules, {"vision": vision.num_tokens})
