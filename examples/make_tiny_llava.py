"""A released-model example that needs no download: one tiny random-init LLaVA folder (a CLIP tower read at its
second-to-last layer, the MLP projector, a Qwen2 LLM; its tokenizer, chat template and image processor beside it)
and the built-in image tasks written out as PNG files with a JSONL of conversations.

    python examples/make_tiny_llava.py runs/tiny_llava
    loom train examples/llava.toml

writes

    OUT/model/  config.json (model_type "llava") + model.safetensors (transformers' names), preprocessor_config.json
                (CLIP's: shorter side 48, a 48 × 48 centre crop), tokenizer.json with <image>, tokenizer_config.json,
                chat_template.json (ChatML that writes <image> for each image part, as LLaVA's processors do)
    OUT/data/   train.jsonl, heldout.jsonl, img/*.png

Weights are drawn as loom draws a module without a folder (models/init.py): a function of --seed, as the data is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))  # make_tiny_vlm beside this file, however it is loaded
import make_tiny_vlm as vlm  # noqa: E402

from loom.models.hf.mapping import config_to_hf  # noqa: E402
from loom.models.hf.names import hf_name  # noqa: E402
from loom.models.llm import DecoderLM  # noqa: E402
from loom.models.projector import Projector  # noqa: E402
from loom.models.vision import VisionConfig, VisionEncoder  # noqa: E402

TASKS = ["digits", "shapes"]
IMAGE = 48  # the tower's image size: every task image is resized and cropped to it
FEATURE_LAYER = -2  # LLaVA 1.5's: the second-to-last layer's output, [CLS] dropped
CHAT_TEMPLATE = (  # ChatML reading content parts, as LLaVA-OneVision's processor template does
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\\n' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def tower_config() -> VisionConfig:
    """The whole CLIP tower as the folder holds it (the last layer and the final norm too, which LLaVA never reads)."""
    return VisionConfig(patch_size=vlm.PATCH, hidden_size=96, num_layers=3, num_heads=4, intermediate_size=384,
                        layer_norm_eps=1e-5, position_grid=IMAGE // vlm.PATCH, act="quick", class_token=True,
                        patch_bias=False, pre_norm=True)


def clip_config(v: VisionConfig) -> dict:
    return {"model_type": "clip_vision_model", "hidden_size": v.hidden_size, "intermediate_size": v.intermediate_size,
            "num_hidden_layers": v.num_layers, "num_attention_heads": v.num_heads, "num_channels": v.channels,
            "image_size": IMAGE, "patch_size": v.patch_size, "hidden_act": "quick_gelu",
            "layer_norm_eps": v.layer_norm_eps, "projection_dim": 64}


def write_tokenizer(folder: Path) -> tuple[int, int]:
    """make_tiny_vlm's BPE with <image> added, LLaVA's processor template beside it; (vocabulary, <image>'s id)."""
    tok = vlm.folder_tokenizer(folder, TASKS, ["<image>"])
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    return tok.get_vocab_size(with_added_tokens=True), tok.token_to_id("<image>")


def write_model(folder: Path, vocab: int, image_token: int, seed: int) -> None:
    # the embedding rounded up to 64 rows, so tensor parallelism divides it (as released folders pad theirs)
    lm_cfg, tower_cfg = vlm.llm_config(-(-vocab // 64) * 64), tower_config()
    with torch.device("meta"):
        parts = {"language": (DecoderLM(lm_cfg), "language.", "language_model.model."),
                 "vision": (VisionEncoder(tower_cfg), "vision.encoder.", "vision_tower."),
                 "projector": (Projector(tower_cfg.hidden_size, lm_cfg.hidden_size), "vision.projector.",
                               "multi_modal_projector.")}
    tensors = {}
    for kind, (module, loom_prefix, hf_prefix) in parts.items():
        std = lm_cfg.init_std if kind == "language" else None
        drawn = vlm.random_tensors(module, loom_prefix, seed, std)
        tensors.update({hf_name(kind, n, hf_prefix, "qwen2", "language_model."): t for n, t in drawn.items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "image_token_index": image_token, "projector_hidden_act": "gelu",
              "vision_feature_layer": FEATURE_LAYER, "vision_feature_select_strategy": "default",
              "text_config": config_to_hf("language", lm_cfg, torch.float32), "vision_config": clip_config(tower_cfg),
              "tie_word_embeddings": lm_cfg.tie_embeddings, "dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    processor = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": IMAGE},
                 "crop_size": {"height": IMAGE, "width": IMAGE}, "do_resize": True, "do_center_crop": True,
                 "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": CLIP_MEAN,
                 "image_std": CLIP_STD, "resample": 3, "do_convert_rgb": True}
    (folder / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict:
    args = vlm.folder_args(__doc__.split("\n\n")[0], "runs/tiny_llava", argv)
    model, data = args.out / "model", args.out / "data"
    vocab, image_token = write_tokenizer(model)
    write_model(model, vocab, image_token, args.seed)
    counts = vlm.write_splits(data, TASKS, args)
    print(f"model  {model}: LLaVA (CLIP tower, patch {vlm.PATCH}, {IMAGE} pixels; Qwen2), vocabulary {vocab}, "
          f"<image> = {image_token}")
    vlm.print_splits(data, counts)
    return {"model": str(model), "vocab": vocab, "image_token": image_token, "conversations": counts}


if __name__ == "__main__":
    main()
