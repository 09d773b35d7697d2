"""The multimodal model: modality encoders (each with its projector) feeding a decoder LLM.

Each top-level child is one *module* in loom's sense (`vision`, `audio`, `language`) and later gets its own
parallel layout; the step driver may therefore call `encode` and the LLM separately.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from loom.model_config import AudioConfig, LLMConfig, VisionConfig
from loom.model_config import ModelConfig  # noqa: F401 (its import path before it moved: kept for callers)
from loom.models.audio import AudioEncoder
from loom.models.llm import DecoderLM
from loom.models.projector import LinearProjector, Projector
from loom.models.qwen2_audio import Qwen2AudioEncoder
from loom.models.qwen2_vision import Qwen2VisionEncoder
from loom.models.tile_rows import TileRows
from loom.models.vision import VisionEncoder


class ModalityEncoder(nn.Module):
    """An encoder and its projector: inputs of one modality → [tokens, llm_hidden]."""

    def __init__(self, encoder: nn.Module, llm_hidden: int, projector_act: str = "gelu", hidden: int = 0,
                 tiles: TileRows | None = None, projector: nn.Module | None = None) -> None:
        """`hidden`: the projector's width between its matmuls (0: llm_hidden; Qwen2-VL's merger: its input's);
        `tiles`: LLaVA-OneVision's anyres images, whose tiles the encoder takes and whose rows it lays out;
        `projector`: one of another shape than the two-layer MLP (Qwen2-Audio's one matmul)."""
        super().__init__()
        self.encoder = encoder
        self.projector = projector or Projector(encoder.out_dim, llm_hidden, projector_act, hidden)
        self.tiles = tiles

    def num_tokens(self, item: torch.Tensor) -> int:
        return self.encoder.num_tokens(item) if self.tiles is None else self.tiles.num_tokens(item)

    def tower_rows(self, item) -> int:
        """Rows the tower runs for `item`: its LLM rows but for anyres tiles (elsewhere a constant factor apart)."""
        return self.num_tokens(item) if self.tiles is None else self.tiles.tower_rows(item)

    def forward(self, items: list[torch.Tensor]) -> torch.Tensor:
        if not items:
            # No item of this modality in the batch: run one minimal input anyway and return no rows, so every
            # replica runs every module each step (FSDP's gathers and reductions need all of them) and the
            # zero-row output still carries the (zero) gradient back through the encoder.
            empty = self.encoder.empty_input() if self.tiles is None else self.tiles.empty_input()
            return self._rows([empty])[:0].clone()  # no view: FSDP warns
        return self._rows(items)

    def _rows(self, items: list) -> torch.Tensor:
        if self.tiles is None:
            return self.projector(self.encoder(items))
        return self.tiles(self.projector(self.encoder(self.tiles.tiles(items))), items)


class MultimodalModel(nn.Module):
    def __init__(self, language: DecoderLM, encoders: dict[str, ModalityEncoder], placeholder_ids: dict[str, int]):
        super().__init__()
        self.language = language
        for name, enc in encoders.items():
            self.add_module(name, enc)
        self.encoder_names = tuple(encoders)
        self.placeholder_ids = {n: placeholder_ids[n] for n in encoders}

    def encoder(self, name: str) -> ModalityEncoder:
        return self.get_submodule(name)

    def encode(self, modality_inputs: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Runs every encoder, also one with no input in this batch (see ModalityEncoder.forward)."""
        return {n: self.encoder(n)(modality_inputs.get(n, [])) for n in self.encoder_names}

    def inserts(
        self, input_ids: torch.Tensor, modality_embeds: dict[str, torch.Tensor], slots: dict[str, int] | None = None
    ) -> dict[int, torch.Tensor]:
        """Placeholder id → embeddings, after checking each modality fills exactly its placeholders.
        `slots` (modality → placeholder count) spares counting them on the device, which syncs the stream."""
        out = {}
        for name, emb in modality_embeds.items():
            pid = self.placeholder_ids[name]
            n_slots = slots[name] if slots is not None else int((input_ids == pid).sum())
            if n_slots != emb.shape[0]:
                raise ValueError(
                    f"{name}: the batch has {n_slots} placeholder tokens but the encoder produced "
                    f"{emb.shape[0]} embeddings; each sample needs one placeholder per encoder output token"
                )
            out[pid] = emb
        return out

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, spans, modality_inputs: dict[str, list[torch.Tensor]]
    ) -> torch.Tensor:
        """Logits for every token of a packed or padded batch."""
        return self.language(input_ids, positions, spans, self.inserts(input_ids, self.encode(modality_inputs)))


def build_model(
    language: LLMConfig,
    vision: VisionConfig | None,
    audio: AudioConfig | None,
    placeholder_ids: dict[str, int],
    make: Callable[[type[nn.Module], object], nn.Module] = lambda cls, cfg: cls(cfg),
) -> MultimodalModel:
    """`make(cls, cfg)` builds the LLM and each encoder (e.g. loading pretrained weights); projectors are new."""
    encoders = {}
    if vision is not None:
        qwen = vision.family in ("qwen2_vl", "qwen2_5_vl")
        tower = make(Qwen2VisionEncoder if qwen else VisionEncoder, vision)
        # Qwen2-VL's merger MLP keeps its input's width in between (LLaVA's projector: the LLM's)
        hidden = tower.out_dim if qwen else 0
        tiles = TileRows(vision, language.hidden_size) if vision.grid_pinpoints else None
        encoders["vision"] = ModalityEncoder(tower, language.hidden_size, vision.projector_act, hidden, tiles)
    if audio is not None and audio.family == "qwen2_audio":  # its pooled tower, one-matmul projector
        tower = make(Qwen2AudioEncoder, audio)
        encoders["audio"] = ModalityEncoder(tower, language.hidden_size,
                                            projector=LinearProjector(tower.out_dim, language.hidden_size))
    elif audio is not None:
        encoders["audio"] = ModalityEncoder(make(AudioEncoder, audio), language.hidden_size)
    return MultimodalModel(make(DecoderLM, language), encoders, placeholder_ids)
