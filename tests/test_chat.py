"""A Hugging Face tokenizer folder + chat template turning conversations into tokens (loom/data/chat.py):
the same ids transformers' apply_chat_template gives, targets exactly the assistant turns, each media item's
placeholder repeated as many times as its encoder emits rows."""

from __future__ import annotations

import pytest
from conftest import CHATML, tiny_chat_tokenizer

from loom.data.chat import ChatTokenizer
from loom.data.conversations import BadSample, Conversation, Part, Turn


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_chat_tokenizer(tmp_path_factory.mktemp("tok"))


def _conversation(*turns) -> Conversation:
    return Conversation(tuple(Turn(role, tuple(parts)) for role, parts in turns), "data.jsonl:7")


def text(s: str) -> Part:
    return Part("text", text=s)


CONV = _conversation(("system", [text("Be brief.")]),
                     ("user", [Part("image"), text("What is this?"), Part("audio")]),
                     ("assistant", [text("A cat.")]),
                     ("user", [text("And this?"), Part("image")]),
                     ("assistant", [text("A dog.")]))


def test_ids_match_transformers_and_targets_are_the_assistant_turns(folder):
    from transformers import PreTrainedTokenizerFast

    chat = ChatTokenizer(folder)
    assert chat.added == ["<|image_pad|>", "<|audio_pad|>"]  # not in the vocabulary: added
    ids, targets = chat.encode(CONV, {"vision": [1, 1], "audio": [1]})
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), chat_template=CHATML)
    hf.add_special_tokens({"additional_special_tokens": ["<|image_pad|>", "<|audio_pad|>"]})
    want = hf.apply_chat_template(chat.messages(CONV), tokenize=True)
    want = want["input_ids"] if not isinstance(want, list) else want
    assert ids == want
    decode = chat.tokenizer.decode
    assert decode([t for t, y in zip(ids, targets) if y], skip_special_tokens=False) == \
        "A cat.<|im_end|>A dog.<|im_end|>"


def test_each_placeholder_becomes_as_many_as_its_item_has_rows(folder):
    chat = ChatTokenizer(folder)
    one, _ = chat.encode(CONV, {"vision": [1, 1], "audio": [1]})
    ids, targets = chat.encode(CONV, {"vision": [5, 2], "audio": [3]})
    image, audio = chat.placeholder_ids["vision"], chat.placeholder_ids["audio"]
    assert ids.count(image) == 7 and ids.count(audio) == 3 and len(ids) == len(one) + 4 + 1 + 2
    first = ids.index(image)
    assert ids[first:first + 5] == [image] * 5 and ids[first + 5] != image
    assert not any(y for t, y in zip(ids, targets) if t in (image, audio))


def test_placeholders_and_items_must_agree(folder):
    chat = ChatTokenizer(folder)
    with pytest.raises(BadSample, match=r"data\.jsonl:7: more <\|image_pad\|> placeholders than vision items"):
        chat.encode(CONV, {"vision": [1], "audio": [1]})
    with pytest.raises(BadSample, match=r"data\.jsonl:7: .*'audio': 1.* no placeholder"):
        chat.encode(CONV, {"vision": [1, 1], "audio": [1, 1]})


def test_a_folder_without_a_chat_template_is_refused(tmp_path, folder):
    (tmp_path / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    with pytest.raises(ValueError, match="no chat template"):
        ChatTokenizer(tmp_path)
