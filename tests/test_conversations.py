"""A user's JSONL conversations (loom/data/conversations.py): the chat format parsed and checked line by
line, every bad line an error naming file:line, and weighted mixing of several files."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from loom.data.conversations import BadSample, ConversationFile, blend


def _write(tmp_path, lines: list) -> ConversationFile:
    (tmp_path / "img").mkdir(exist_ok=True)
    (tmp_path / "img" / "1.png").write_bytes(b"not decoded here")
    (tmp_path / "a.wav").write_bytes(b"nor this")
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    (tmp_path / "data.jsonl").write_text(text)
    return ConversationFile(tmp_path / "data.jsonl")


GOOD = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "image", "path": "img/1.png"}, {"type": "text", "text": "What is it?"},
                                 {"type": "audio", "path": "a.wav"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}


def test_a_conversation_is_parsed_with_its_media_resolved(tmp_path):
    data = _write(tmp_path, ["", GOOD, "   ", GOOD])
    assert len(data) == 2  # blank lines are not conversations
    c = data[1]
    assert c.where == f"{tmp_path / 'data.jsonl'}:4"
    assert [t.role for t in c.turns] == ["system", "user", "assistant"]
    assert c.turns[0].parts[0].text == "Be brief."
    assert c.media("image") == [(tmp_path / "img" / "1.png").resolve()]
    assert c.media("audio") == [(tmp_path / "a.wav").resolve()]
    assert c.turns[2].parts[0].text == "A cat."


def _with(**change) -> dict:
    messages = json.loads(json.dumps(GOOD["messages"]))
    for index, message in change.items():
        messages[int(index[1:])] = message
    return {"messages": messages}


BAD = [
    ('{"messages": [', "not valid JSON"),
    ({"conversation": []}, "non-empty \"messages\" list"),
    (_with(m1={"role": "robot", "content": "hi"}), "messages[1]: unknown role 'robot'"),
    (_with(m1={"role": "user", "content": 3}), "messages[1]: \"content\" must be a string or a list"),
    (_with(m1={"role": "user", "content": [{"type": "video", "path": "v.mp4"}]}),
     "messages[1].content[0]: unknown part type 'video'"),
    (_with(m1={"role": "user", "content": [{"type": "image", "path": "img/missing.png"}]}),
     "messages[1].content[0]: image file 'img/missing.png' not found"),
    (_with(m1={"role": "user", "content": [{"type": "text"}]}), "a text part needs a \"text\" string"),
    ({"messages": [GOOD["messages"][1]]}, "no assistant turn"),
    ({**GOOD, "task": 7}, "\"task\" must be a non-empty string"),
]


@pytest.mark.parametrize("line,fragment", BAD, ids=[f[1][:30] for f in BAD])
def test_a_bad_line_is_an_error_naming_file_and_line(tmp_path, line, fragment):
    data = _write(tmp_path, [GOOD, "", line])
    data[0]  # the good line before it reads fine
    with pytest.raises(BadSample) as e:
        data[1]
    assert str(e.value).startswith(f"{tmp_path / 'data.jsonl'}:3: ")
    assert fragment in str(e.value)


def test_a_line_that_is_not_utf8_is_an_error_naming_it(tmp_path):
    (tmp_path / "data.jsonl").write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"messages": "\xff"}\n')
    with pytest.raises(BadSample, match=r"data\.jsonl:2: not UTF-8"):
        ConversationFile(tmp_path / "data.jsonl")[1]


def test_blend_follows_the_weights_in_a_fixed_order():
    mix = blend([10, 3, 1000], [2.0, 1.0, 1.0], 400)
    counts = Counter(s for s, _ in mix)
    assert counts == {0: 200, 1: 100, 2: 100}  # exactly the shares at a multiple of the weights' sum
    for j in range(1, 401):  # and never more than one away from them on the way
        prefix = Counter(s for s, _ in mix[:j])
        assert all(abs(prefix[s] - j * w / 4) <= 1 for s, w in enumerate([2, 1, 1]))
    assert [i for s, i in mix if s == 1][:7] == [0, 1, 2, 0, 1, 2, 0]  # a used-up source wraps around
    assert mix == blend([10, 3, 1000], [2.0, 1.0, 1.0], 400)


@pytest.mark.parametrize("sizes,weights", [([3, 0], [1, 1]), ([3, 3], [1, 0]), ([3], [1, 1])])
def test_blend_refuses_empty_sources_and_bad_weights(sizes, weights):
    with pytest.raises(ValueError):
        blend(sizes, weights, 5)


def test_a_control_character_in_a_string_is_named_once(tmp_path):
    line = '{"messages": [{"role": "user", "content": "a\tb"}]}'  # a raw tab in a JSON string
    data = _write(tmp_path, [line])
    with pytest.raises(BadSample) as e:
        data[0]
    assert "Invalid control character" in str(e.value) and " at at " not in str(e.value)
    column = line.index("\t") + 1  # 1-based, as json counts
    assert str(e.value).endswith(f"at column {column})")
