"""A job's model on the meta device, where each weight's first value comes from, and the small things every
build needs (the device, the encoders' token counters, the global batches)."""

from __future__ import annotations

import torch

from loom.config import JobConfig
from loom.data.format import RowCounter, TokenCounter
from loom.data.loader import GlobalBatches
from loom.data.sample import Sample, SamplePair
from loom.data.tokenizer import Vocabulary
from loom.models.hf import HFWeights
from loom.models.multimodal import MultimodalModel, build_model
from loom.parallel.materialize import InitialWeights
from loom.train.job_data import JobData
from loom.train.optim import freeze_modules


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device(name)


def build_job_model(cfg: JobConfig, tok: Vocabulary) -> MultimodalModel:
    """The job's model on the `meta` device: shapes only. Storage and values come after the layout is
    applied (`setup_parallel` → parallel/materialize.py), so no rank ever holds the whole model."""
    m = cfg.model
    with torch.device("meta"):
        model = build_model(m.language, m.vision if "vision" in m.encoders else None,
                            m.audio if "audio" in m.encoders else None, tok.placeholder_ids)
    freeze_modules(model, [*model.encoder_names, "language"], cfg.train)
    return model


def initial_weights(model: MultimodalModel, cfg: JobConfig, pretrained: bool = True) -> InitialWeights:
    """Where each weight's first value comes from: the folder of a module whose `hf` is set (when
    `pretrained`; every name and shape is checked now, from the files' headers, before anything is read),
    else a draw seeded by its name. Projectors start from draws, except a whole-model folder's (`model.hf`)."""
    folders = {}
    for name in (*model.encoder_names, "language") if pretrained else ():
        folder = getattr(cfg.model, name).hf
        if folder:
            module = model.language if name == "language" else model.encoder(name).encoder
            prefix = "language." if name == "language" else f"{name}.encoder."
            grown = ("embed_tokens.weight", "lm_head.weight") if name == "language" else ()  # job_data.with_vocabulary
            folders[prefix] = HFWeights(folder, module, grown)
    if pretrained and cfg.model.hf:  # a whole-model folder holds the projector too (of its one encoder)
        name = model.encoder_names[0]
        folders[f"{name}.projector."] = HFWeights(cfg.model.hf, model.encoder(name).projector)
        if model.encoder(name).tiles is not None:  # LLaVA-OneVision's image_newline
            folders[f"{name}.tiles."] = HFWeights(cfg.model.hf, model.encoder(name).tiles)
    return InitialWeights(cfg.train.seed, cfg.model.language.init_std, folders)


def token_counters(model: MultimodalModel) -> dict[str, TokenCounter]:
    return {n: RowCounter(model.encoder(n).num_tokens, model.encoder(n).tower_rows) for n in model.encoder_names}


def build_batches(cfg: JobConfig, data: JobData) -> GlobalBatches[Sample | SamplePair]:
    """Global batches of the job's training items (a sample found bad when drawn: train/step_data.py);
    `train.global_batch_size` counts sequences, so under DPO a batch draws half as many pairs."""
    return GlobalBatches(data.train, cfg.train.global_batch_size // cfg.train.sequences_per_item, cfg.data.seed)
