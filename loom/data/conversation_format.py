"""A checked Conversation → a Sample: its media decoded for the encoders, its text tokenised through the chat
template, each image's and clip's placeholder repeated once per row its encoder emits for it."""

from __future__ import annotations

from dataclasses import dataclass

from loom.data.anyres_images import tiled_file
from loom.data.audio import audio_file
from loom.data.chat import ChatTokenizer
from loom.data.conversations import MODULE_OF, BadSample, Conversation
from loom.data.format import TokenCounter
from loom.data.images import ImageRule, image_file
from loom.data.sample import MediaFile, Sample, SamplePair


@dataclass(frozen=True)
class MediaRules:
    image: ImageRule
    n_mels: int  # the audio encoder's input features
    audio_padded_to: int = 0  # the samples a whole-model folder's processor pads a clip to (Qwen2-Audio's); 0: none


def conversation_sample(conv: Conversation, chat: ChatTokenizer, rules: MediaRules,
                        counters: dict[str, TokenCounter], task: str = "", train_on: str = "assistant"
                        ) -> Sample | SamplePair:
    """`counters`: encoder name → rows it emits for an item (a model without that encoder has none: an item
    for it is a BadSample). Media stay files (MediaFile): only their headers are read here. A DPO line gives a
    pair, each side trained on its answer alone."""
    if conv.answers is not None:
        chosen, rejected = (_answer_sample(side, chat, rules, counters, task) for side in conv.sides())
        if chosen.tokens == rejected.tokens:
            raise BadSample(f"{conv.where}: \"chosen\" and \"rejected\" tokenise to the same {len(chosen)} tokens: "
                            f"the pair teaches nothing")
        return SamplePair(chosen, rejected)
    images, clips, rows = media_items(conv, rules, counters)
    ids, targets = chat.encode(conv, rows, train_on)
    fields = {}
    if conv.rl:  # an RL line: only the completion (the last assistant turn) is trained
        targets, fields = completion_fields(conv, targets)
    return Sample(ids, targets, images, clips, conv.task or task, conv.where, fields)


def media_items(conv: Conversation, rules: MediaRules, counters: dict[str, TokenCounter]
                ) -> tuple[list[MediaFile], list[MediaFile], dict[str, list[int]]]:
    """The conversation's images and clips (headers read, not decoded) and the rows each encoder emits for
    them; an item for an encoder the model lacks is a BadSample."""
    for kind, module in MODULE_OF.items():
        if conv.items(kind) and module not in counters:
            raise BadSample(f"{conv.where}: has {kind} items but the model has no {module} encoder")
    parts, rule = conv.items("image"), rules.image
    if rule.anyres is not None:  # LLaVA-OneVision's tiles; an image among several is not tiled, as its processor does
        images = [tiled_file(p.source, rule, len(parts) == 1, conv.where, p.name) for p in parts]
    else:
        images = [image_file(p.source, rule, conv.where, p.name) for p in parts]
    clips = [audio_file(p.source, rules.n_mels, conv.where, p.name, rules.audio_padded_to) for p in conv.items("audio")]
    rows = {module: [counters[module](x) for x in items] for module, items in (("vision", images), ("audio", clips))
            if items}
    return images, clips, rows


def _answer_sample(conv: Conversation, chat: ChatTokenizer, rules: MediaRules, counters: dict[str, TokenCounter],
                   task: str) -> Sample:
    """One side of a DPO pair: only its answer (the last assistant turn) is a target."""
    sample = conversation_sample(conv, chat, rules, counters, task)
    sample.supervised = completion_fields(conv, sample.supervised)[0]
    return sample


def completion_fields(conv: Conversation, targets: list[bool]) -> tuple[list[bool], dict[str, list[float]]]:
    """The targets of the last assistant turn alone (its tokens are the last run of targets), and the line's
    RL values as token fields aligned with the labels: a completion token's value sits at the position before
    it, where its label is (Sample.token_fields)."""
    last = max((i for i, t in enumerate(targets) if t), default=-1)
    first = last
    while first > 0 and targets[first - 1]:
        first -= 1
    kept = [first <= i <= last for i in range(len(targets))]
    positions = [i - 1 for i in range(first, last + 1) if i > 0]  # label positions of the completion's tokens
    fields: dict[str, list[float]] = {}
    for name, value in conv.rl.items():
        column = [0.0] * len(targets)
        if isinstance(value, float):  # the advantage: every completion token's
            for i in positions:
                column[i] = value
        else:
            if len(value) != len(positions):
                raise BadSample(f"{conv.where}: \"{name}\" has {len(value)} values, but the completion (the last "
                                f"assistant turn) is {len(positions)} tokens under this tokenizer and template")
            for i, v in zip(positions, value):
                column[i] = v
        fields[name] = column
    return kept, fields
