"""A checked Conversation → a Sample: its media decoded for the encoders, its text tokenised through the chat
template, each image's and clip's placeholder repeated once per row its encoder emits for it."""

from __future__ import annotations

from dataclasses import dataclass

from loom.data.audio import audio_file
from loom.data.chat import ChatTokenizer
from loom.data.conversations import MODULE_OF, BadSample, Conversation
from loom.data.format import TokenCounter
from loom.data.images import ImageRule, image_file
from loom.data.sample import Sample


@dataclass(frozen=True)
class MediaRules:
    image: ImageRule
    n_mels: int  # the audio encoder's input features


def conversation_sample(conv: Conversation, chat: ChatTokenizer, rules: MediaRules,
                        counters: dict[str, TokenCounter], task: str = "", train_on: str = "assistant") -> Sample:
    """`counters`: encoder name → rows it emits for an item (a model without that encoder has none: an item
    for it is a BadSample). Media stay files (MediaFile): only their headers are read here."""
    for kind, module in MODULE_OF.items():
        if conv.items(kind) and module not in counters:
            raise BadSample(f"{conv.where}: has {kind} items but the model has no {module} encoder")
    images = [image_file(p.source, rules.image, conv.where, p.name) for p in conv.items("image")]
    clips = [audio_file(p.source, rules.n_mels, conv.where, p.name) for p in conv.items("audio")]
    rows = {module: [counters[module](x) for x in items] for module, items in (("vision", images), ("audio", clips))
            if items}
    ids, targets = chat.encode(conv, rows, train_on)
    return Sample(ids, targets, images, clips, conv.task or task, conv.where)
