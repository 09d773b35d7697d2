"""Byte-level tokenizer with special tokens: needs no download and round-trips any UTF-8 text."""

from __future__ import annotations

from typing import Protocol

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<image>", "<audio>")


class Vocabulary(Protocol):
    """What training and evaluation need of a tokenizer (this ByteTokenizer, data/chat.py's ChatTokenizer)."""

    pad_id: int  # fills slots that carry no label
    eos_id: int  # ends an answer: generation stops at it
    placeholder_ids: dict[str, int]  # encoder → the token its rows replace

    @property
    def vocab_size(self) -> int: ...

    def decode(self, ids: list[int]) -> str: ...  # generated text, up to the end of the answer


class ByteTokenizer:
    """Ids 0..255 are raw bytes; the special tokens follow."""

    def __init__(self) -> None:
        self.special = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.pad_id = self.special["<pad>"]
        self.bos_id = self.special["<bos>"]
        self.eos_id = self.special["<eos>"]
        # one placeholder token per modality; a sample holds as many as the encoder emits for it
        self.placeholder_ids = {"vision": self.special["<image>"], "audio": self.special["<audio>"]}

    @property
    def vocab_size(self) -> int:
        return 256 + len(SPECIAL_TOKENS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Decodes bytes, stops at <eos>, skips other special tokens."""
        out = bytearray()
        for i in ids:
            if i == self.eos_id:
                break
            if i < 256:
                out.append(i)
        return out.decode("utf-8", errors="replace")
