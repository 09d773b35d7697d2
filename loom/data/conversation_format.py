"""A checked Conversation → a Sample: its media decoded for the encoders, its text tokenised through the chat
template, each image's and clip's placeholder repeated once per row its encoder emits for it."""

from __future__ import annotations

from dataclasses import dataclass

from loom.data.audio import load_audio, log_mel
from loom.data.chat import ChatTokenizer
from loom.data.conversations import BadSample, Conversation
from loom.data.format import TokenCounter
from loom.data.images import ImageRule, load_image
from loom.data.sample import Sample

MODULE_OF = {"image": "vision", "audio": "audio"}  # a part's kind → the encoder that reads it


@dataclass(frozen=True)
class MediaRules:
    image: ImageRule
    n_mels: int  # the audio encoder's input features


def conversation_sample(conv: Conversation, chat: ChatTokenizer, rules: MediaRules,
                        counters: dict[str, TokenCounter], task: str = "") -> Sample:
    """`counters`: encoder name → rows it emits for an item (a model without that encoder has none: an item
    for it is a BadSample)."""
    for kind, module in MODULE_OF.items():
        if conv.media(kind) and module not in counters:
            raise BadSample(f"{conv.where}: has {kind} items but the model has no {module} encoder")
    images = [load_image(p, rules.image, conv.where) for p in conv.media("image")]
    clips = [log_mel(load_audio(p, conv.where), rules.n_mels) for p in conv.media("audio")]
    rows = {"image": [counters["vision"](x) for x in images], "audio": [counters["audio"](c) for c in clips]}
    ids, targets = chat.encode(conv, rows)
    return Sample(ids, targets, images, clips, task)
