"""What a job trains and evaluates on, built from its config after the model's shapes and before its weights:
the tokenizer, the training samples by index, the held-out samples, and the samples skipped as bad.

Built-in tasks (no `data.sources`): the byte tokenizer, tasks drawn by index. A user's data: the Hugging Face
tokenizer folder `model.tokenizer` with its chat template, the `[[data.sources]]` JSONL files checked line by
line now (a bad line stops the run here, before any weight is read, or is skipped), mixed by weight; the
held-out conversations are `data.heldout`'s, or the last `data.heldout_size` split off the sources.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from loom.config import ConfigError, JobConfig
from loom.data.anyres import Anyres
from loom.data.anyres_images import check_processor
from loom.data.audio import processor_samples
from loom.data.batch import round_up
from loom.data.chat import ChatTokenizer
from loom.data.conversation_format import MediaRules
from loom.data.conversations import BadSample
from loom.data.format import TokenCounter, to_sample
from loom.data.images import ImageRule, PreprocessorConfigError
from loom.data.sample import Sample, SamplePair, decoded, sequences_of
from loom.data.shape_table import known_table, measured_table
from loom.data.source import (
    BadSamples,
    ChatRules,
    ConversationSamples,
    TaskSamples,
    checked,
    conversation_source,
    split_off,
)
from loom.data.tasks import TaskDataset, longest_example
from loom.data.tokenizer import ByteTokenizer, Vocabulary
from loom.models.hf.load import read_hf_config
from loom.models.hf.whole import encoder_of, family_of
from loom.train.prescan import prescan, scan
from loom.train.prescan_cache import PrescanCache

VOCAB_MULTIPLE = 64  # a grown vocabulary is rounded up to this, so tensor parallelism still divides it


def job_tokenizer(cfg: JobConfig) -> Vocabulary:
    """The byte tokenizer for the built-in tasks, else `model.tokenizer`'s (its placeholders added if missing)."""
    if not cfg.data.sources:
        return ByteTokenizer()
    # a whole-model folder's placeholder is its family's (LLaVA's "<image>", Qwen2-VL's "<|image_pad|>", Qwen2-Audio's
    # "<|AUDIO|>")
    family = family_of(read_hf_config(cfg.model.hf)) if cfg.model.hf else None
    placeholders = {encoder_of(family): family.PLACEHOLDER} if family else None
    try:
        return ChatTokenizer(cfg.model.tokenizer, placeholders)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.tokenizer = {cfg.model.tokenizer!r}: {e}") from None


def with_vocabulary(cfg: JobConfig, tok: Vocabulary) -> JobConfig:
    """`cfg` with the LLM's vocabulary grown to hold every id of `tok` (e.g. the media placeholders a pretrained
    tokenizer lacked), rounded up to a multiple of 64; the new embedding rows start from the model's own
    initial draw (they feed no input — placeholders are replaced by encoder rows — and are never targets)."""
    lm = cfg.model.language
    if tok.vocab_size <= lm.vocab_size:
        return cfg
    grown = dataclasses.replace(lm, vocab_size=round_up(tok.vocab_size, VOCAB_MULTIPLE))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, language=grown))


@dataclass
class JobData:
    tok: Vocabulary
    train: Sequence[Sample]  # by index: GlobalBatches draws global batches from it
    heldout: list[Sample]  # media decoded
    longest: dict[str, int]  # source → its longest sample in tokens, where known before drawing (built-in tasks)
    bad: BadSamples = field(default_factory=BadSamples)


def build_job_data(cfg: JobConfig, tok: Vocabulary, counters: dict[str, TokenCounter],
                   multiple: int | None = None, rollouts: bool = False) -> JobData:
    """`counters`: encoder → rows it emits for an item (the model's, built on meta); `multiple`: the LLM's
    sample multiple under the job's layout, when known — the prescan then also refuses a sample over the token
    budget (unless data.too_long = "skip"); `rollouts`: `loom rl` trains on its own samples, so no line needs
    GRPO's values."""
    d = cfg.data
    if not d.sources:
        sizes = dict(patch_size=cfg.model.vision.patch_size, n_audio_features=cfg.model.audio.num_features)
        train = TaskDataset(d.tasks, "train", d.train_size, seed=d.seed, **sizes)
        heldout = TaskSamples(TaskDataset(d.tasks, "heldout", d.heldout_size, seed=d.seed, **sizes), tok, counters)
        longest = {f"task {t!r}": len(to_sample(longest_example(t, **sizes), tok, counters)) for t in d.tasks}
        pairs = cfg.train.objective == "dpo"
        samples = TaskSamples(train, tok, counters, pairs)
        # each item's shape measured once (split over the ranks), so a step looks its samples up
        samples.table = measured_table(len(samples), 2 if pairs else 1, list(counters), samples.shape)
        return JobData(tok, samples, [heldout[i] for i in range(len(heldout))], longest)
    bad = BadSamples()
    weights = [s.weight for s in d.sources]
    rules = ChatRules(tok, media_rules(cfg), d.train_on)
    sources = [conversation_source(s.path) for s in d.sources]
    held = [conversation_source(d.heldout)] if d.heldout else []
    # every line's problems and shapes (a step then renders only its share), the lines shared over the ranks
    cache = PrescanCache.of(cfg, multiple, rollouts) if d.prescan_cache else None
    found = scan(sources + held, prescan(cfg, rules, counters, multiple, rollouts), cache)
    measured = {f.where(i): s for f, (_, shapes) in zip(sources, found) for i, s in shapes.items()}
    files = checked(sources, d.on_bad_sample, bad, [problems for problems, _ in found[:len(sources)]])
    if d.heldout:
        held = checked(held, d.on_bad_sample, bad, [found[-1][0]])
    else:
        files, held = split_off(files, weights, d.heldout_size)
    train = ConversationSamples.mixture(files, weights, rules, counters, measured)
    per_item = cfg.train.sequences_per_item
    # the prescan's shapes are on every rank already: the table is filled here, so a step looks its cells up
    train.table = known_table(len(train), per_item, list(counters), train.shape)
    if cfg.train.global_batch_size > per_item * len(train):
        raise ConfigError(f"train.global_batch_size = {cfg.train.global_batch_size} exceeds the {len(train)} "
                          f"training conversations of data.sources" + (" (two sequences each)" if per_item > 1 else ""))
    heldout = ConversationSamples.mixture(held, [1.0] * len(held), rules, counters) if held else []
    return JobData(tok, train, _loaded(heldout, d.on_bad_sample, bad), {}, bad)


def media_rules(cfg: JobConfig) -> MediaRules:
    """Images: whole patches within [data.image_min_pixels, data.image_max_pixels] (default: one patch, and
    the encoder's position grid), normalised with the vision folder's mean and std; audio: its mel bins, and a
    Qwen2-Audio folder's clips padded as its processor pads them."""
    v, d, a = cfg.model.vision, cfg.data, cfg.model.audio
    padded_to = 0
    if a.family == "qwen2_audio" and a.hf:
        try:
            padded_to = processor_samples(a.hf, a.num_features)
        except ValueError as e:
            raise ConfigError(f"model.hf = {a.hf!r}: {e}") from None
    p = v.patch_size
    low, high = d.image_min_pixels or p * p, d.image_max_pixels or (v.position_grid * p) ** 2
    try:
        image = ImageRule.of(p, low, high, v.hf or None, processor_sizes=bool(cfg.model.hf and v.hf))
        if v.grid_pinpoints:  # LLaVA-OneVision's tiles, cut for the canvases its config.json names
            image = dataclasses.replace(image, anyres=Anyres.of(v.grid_pinpoints, v.position_grid * p,
                                                                v.position_grid, v.max_tiles))
            if v.hf:
                check_processor(v.hf, image)
    except PreprocessorConfigError as e:
        raise ConfigError(f"model.{'' if cfg.model.hf else 'vision.'}hf = {v.hf!r}: {e}") from None
    except ValueError as e:
        raise ConfigError(f"data.image_min_pixels / data.image_max_pixels: {e}") from None
    return MediaRules(image, a.num_features, padded_to)


def _loaded(samples: Sequence[Sample | SamplePair], on_bad: str, bad: BadSamples) -> list[Sample]:
    """Every sample with its media decoded now (the held-out set is small and read at every evaluation); of a
    DPO pair, the chosen answer (the held-out pass measures its token loss and accuracy)."""
    out = []
    for i in range(len(samples)):
        try:
            s = sequences_of(samples[i])[0]
            out.append(dataclasses.replace(s, images=[decoded(x) for x in s.images],
                                           audio=[decoded(x) for x in s.audio]))
        except BadSample as e:
            if on_bad == "error":
                raise
            bad.add(samples.where(i), str(e))
    return out
