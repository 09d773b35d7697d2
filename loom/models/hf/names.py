"""What a Hugging Face checkpoint's tensors are called: loom's module-relative names ↔ the checkpoint's, per kind of
module (and per family where a family names them its own way: Mixtral), where a module's tensors sit in a
checkpoint, and which of a checkpoint's tensors are deliberately not loaded."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from loom.models.hf import qwen2_vl
from loom.models.hf.errors import HFError
from loom.models.hf.mapping import llm_family
from loom.models.hf.mixtral import RENAMES as MIXTRAL_RENAMES
from loom.models.hf.whole import family_of

# module-relative loom name → HF name without prefix; rules are anchored and applied in order
_RENAMES = {
    "language": [],
    "vision": [
        (r"^(patch_embedding|position_embedding)\.", r"embeddings.\1."),
        (r"^class_embedding$", "embeddings.class_embedding"),  # CLIP's [CLS] row
        (r"^layers\.", "encoder.layers."),
    ],
    "audio": [
        (r"^embed_positions$", "embed_positions.weight"),  # a buffer in loom, an nn.Embedding in Whisper
        (r"^(layers\.\d+)\.layer_norm1\.", r"\1.self_attn_layer_norm."),
        (r"^(layers\.\d+)\.layer_norm2\.", r"\1.final_layer_norm."),
        (r"^(layers\.\d+)\.mlp\.", r"\1."),
    ],
    "projector": [],
    "tiles": [],  # LLaVA-OneVision's image_newline
}
FAMILY_RENAMES = {"mixtral": MIXTRAL_RENAMES, **qwen2_vl.RENAMES}
# loom tensors that are a row block of a folder's fused tensor: (pattern, block, blocks) per family
FAMILY_FUSED = dict(qwen2_vl.FUSED)
# where the module's tensors sit in the checkpoint: tried in order, recognised by the anchor tensor
PREFIXES = {
    "language": ("model.", ""),  # *ForCausalLM, or a bare *Model
    "vision": ("vision_model.", ""),  # SiglipModel / transformers-4 SiglipVisionModel, or transformers-5's
    "audio": ("model.encoder.", "encoder.", ""),  # WhisperForConditionalGeneration, WhisperModel, WhisperEncoder
}
ANCHORS = {"language": "embed_tokens.weight", "vision": "embeddings.patch_embedding.weight", "audio": "conv1.weight"}
EXPORT_PREFIXES = {"language": "model.", "vision": "vision_model.", "audio": ""}  # what transformers 4 and 5 load


@dataclass(frozen=True)
class Part:
    """Where one loom module sits in a folder: its own config (a whole-model folder's sub-config), the prefix of
    its tensors and of its LM head's, and the whole config.json when the folder holds more than this module."""

    hf: dict
    prefix: str
    head_prefix: str = ""
    whole: dict | None = None


def locate(kind: str, hf: dict, names, where: str) -> Part:
    """Where the `kind` module's tensors sit among the checkpoint's tensor `names` (config.json `hf`)."""
    family = family_of(hf)
    if family is not None:
        return Part(family.sub_config(hf, kind), *family.part_prefix(kind, names, where), whole=hf)
    return Part(hf, detect_prefix(kind, names, where))


def hf_name(kind: str, name: str, prefix: str, family: str = "", head_prefix: str = "") -> str:
    """The checkpoint name of module-relative loom tensor `name`; `family`: the config's model_type, for the
    families whose names differ from loom's (Mixtral's); `head_prefix`: the LM head's (LLaVA's language_model.)."""
    if kind == "language" and name.startswith("lm_head."):
        return head_prefix + name  # outside the base model in every *ForCausalLM
    for pattern, repl in _RENAMES[kind] + FAMILY_RENAMES.get(family, []):
        name = re.sub(pattern, repl, name)
    return prefix + name


def fused_block(name: str, family: str = "") -> tuple[int, int] | None:
    """(block, blocks): module-relative loom tensor `name` is row block `block` of `blocks` equal ones of the folder
    tensor hf_name gives (Qwen2-VL's q/k/v of its fused qkv); None: the whole tensor."""
    for pattern, block, blocks in FAMILY_FUSED.get(family, []):
        if re.search(pattern, name):
            return block, blocks
    return None


def block_of(t: torch.Tensor, name: str, family: str = "") -> torch.Tensor:
    """Loom tensor `name`'s part of `t`, the folder tensor hf_name gives: its row block if fused, else all of it."""
    block = fused_block(name, family)
    return t if block is None else t.chunk(block[1])[block[0]]


def join_fused(named: dict, family: str = "") -> dict:
    """{loom name: (folder name, tensor)} → {folder name: tensor}: a fused folder tensor's blocks joined in order."""
    out, blocks = {}, {}
    for n, (h, t) in named.items():
        block = fused_block(n, family)
        if block is None:
            out[h] = t
        else:
            blocks.setdefault(h, []).append((block[0], t))
    out.update({h: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) for h, parts in blocks.items()})
    return out


def names_family(kind: str, cfg) -> str:
    """The family a module's tensors are named by when streamed or exported (Mixtral's differ from loom's); "" for
    a module no Hugging Face family describes, which keeps loom's names."""
    if kind != "language":
        return ""
    try:
        return llm_family(cfg)
    except HFError:
        return ""


def detect_prefix(kind: str, names, where: str) -> str:
    for prefix in PREFIXES[kind]:
        if prefix + ANCHORS[kind] in names:
            return prefix
    tried = [p + ANCHORS[kind] for p in PREFIXES[kind]]
    raise HFError(f"{where}: no {kind} tensors found: none of {tried} is in the checkpoint")


def skip_reason(kind: str, name: str, part: Part, layers: int = 0) -> str | None:
    """Why the checkpoint tensor `name` is deliberately not loaded; None: it must map onto the module. `layers`: the
    module's layer count (a LLaVA tower's: the layers after it are not read)."""
    prefix, hf = part.prefix, part.hf
    if part.whole is not None:
        family = family_of(part.whole)
        if family.other_part(kind, name, prefix, part.head_prefix):
            return f"another module's: the folder holds a whole {family.FAMILY} model"
        if kind == "vision" and (reason := family.unread_tower_reason(name, prefix, layers)):
            return reason
    if kind == "language":
        if name == part.head_prefix + "lm_head.weight" and hf.get("tie_word_embeddings"):
            return "tied to embed_tokens (some tied checkpoints store it anyway)"
        if name.endswith(".rotary_emb.inv_freq"):
            return "rotary frequencies, recomputed from the config (older checkpoints saved them)"
        layer = re.match(rf"^{re.escape(prefix)}layers\.(\d+)\.", name)
        mtp = hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers")
        if layer and mtp and int(layer.group(1)) >= hf["num_hidden_layers"]:
            return "multi-token-prediction layers (DeepSeek's, GLM's: after the last layer), which loom does not train"
    elif kind == "vision":
        if name.startswith(prefix + "head."):
            return "SigLIP's attention-pooling head; VLMs use the patch features before it"
        text_side = name.startswith("text_model.") or name in ("logit_scale", "logit_bias")
        if hf.get("model_type") == "siglip" and text_side:
            return "SigLIP's text tower and contrastive logit scale/bias"
    elif kind == "audio" and prefix:
        parent = prefix[: -len("encoder.")]
        if name.startswith(parent + "decoder.") or name == "proj_out.weight":
            return "Whisper's text decoder"
    return None
