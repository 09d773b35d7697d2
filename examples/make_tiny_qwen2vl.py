"""A released-model example that needs no download: one tiny random-init Qwen2-VL folder (its vision tower with the
2×2 patch merger, a Qwen2 LLM with M-RoPE; its tokenizer, chat template and image processor beside it) and the
built-in image tasks written out as PNG files with a JSONL of conversations. `--family qwen2_5_vl` writes a
Qwen2.5-VL folder instead: its tower with RMSNorm, a SwiGLU MLP and 112-pixel windows, one layer attending whole
images; images sized to span several windows.

    python examples/make_tiny_qwen2vl.py runs/tiny_qwen2vl
    loom train examples/qwen2vl.toml
    python examples/make_tiny_qwen2vl.py runs/tiny_qwen2_5_vl --family qwen2_5_vl
    loom train examples/qwen2_5_vl.toml

writes

    OUT/model/  config.json (model_type "qwen2_vl") + model.safetensors (transformers' names), preprocessor_config.json
                (Qwen2VLImageProcessor's: smart_resize to 4–16 merged tokens an image), tokenizer.json with the vision
                tokens, tokenizer_config.json, chat_template.json (Qwen2-VL's: <|vision_start|><|image_pad|>
                <|vision_end|> for each image part)
    OUT/data/   train.jsonl, heldout.jsonl, img/*.png

Weights are drawn as loom draws a module without a folder (models/init.py): a function of --seed, as the data is.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))  # make_tiny_vlm beside this file, however it is loaded
import make_tiny_vlm as vlm  # noqa: E402

from loom.models.hf.mapping import config_to_hf  # noqa: E402
from loom.models.hf.names import hf_name, join_fused  # noqa: E402
from loom.models.llm import DecoderLM  # noqa: E402
from loom.models.projector import Projector  # noqa: E402
from loom.models.qwen2_vision import Qwen2VisionEncoder  # noqa: E402
from loom.models.vision import VisionConfig  # noqa: E402

TASKS = ["digits", "shapes"]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (  # Qwen2-VL-Instruct's (its chat_template.json), picture numbering off
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# LLM tokens an image: 4 to 16 (Qwen2-VL), 20 to 30 for Qwen2.5-VL (more than one 112-pixel window of 4 × 4)
PIXELS = {"qwen2_vl": (28 * 28 * 4, 28 * 28 * 16), "qwen2_5_vl": (28 * 28 * 20, 28 * 28 * 30)}
WINDOW, FULL_ATTENTION = 112, [1]  # Qwen2.5-VL's windows in pixels; its layers attending whole images


def tower_config(family: str = "qwen2_vl") -> VisionConfig:
    if family == "qwen2_5_vl":
        return VisionConfig(family=family, patch_size=14, hidden_size=64, num_layers=3, num_heads=4,
                            intermediate_size=128, act="none", layer_norm_eps=1e-6, window_size=WINDOW,
                            full_attention_layers=FULL_ATTENTION)
    return VisionConfig(family=family, patch_size=14, hidden_size=64, num_layers=2, num_heads=4,
                        intermediate_size=256, act="quick", layer_norm_eps=1e-6)


def vision_json(tower_cfg: VisionConfig, llm_hidden: int) -> dict:
    """config.json's vision_config for the tower."""
    common = {"depth": tower_cfg.num_layers, "num_heads": tower_cfg.num_heads, "in_channels": 3, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "model_type": f"{tower_cfg.family}_vision"}
    if tower_cfg.family == "qwen2_5_vl":
        return dict(common, hidden_size=tower_cfg.hidden_size, intermediate_size=tower_cfg.intermediate_size,
                    out_hidden_size=llm_hidden, hidden_act="silu", window_size=WINDOW,
                    fullatt_block_indexes=FULL_ATTENTION)
    return dict(common, embed_dim=tower_cfg.hidden_size, mlp_ratio=tower_cfg.intermediate_size // tower_cfg.hidden_size,
                hidden_size=llm_hidden, hidden_act="quick_gelu")


def write_tokenizer(folder: Path) -> tuple[int, dict[str, int]]:
    """make_tiny_vlm's BPE with Qwen2-VL's vision tokens added, its processor template beside it; (vocabulary,
    each vision token's id)."""
    tok = vlm.folder_tokenizer(folder, TASKS, VISION_TOKENS)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    return tok.get_vocab_size(with_added_tokens=True), {t: tok.token_to_id(t) for t in VISION_TOKENS}


def write_model(folder: Path, vocab: int, ids: dict[str, int], seed: int, family: str = "qwen2_vl") -> None:
    # the embedding rounded up to 64 rows, so tensor parallelism divides it; M-RoPE over the head's 16 frequencies
    lm_cfg = dataclasses.replace(vlm.llm_config(-(-vocab // 64) * 64),
                                 rope_scaling={"rope_type": "mrope", "mrope_section": [4, 6, 6]})
    tower_cfg = tower_config(family)
    with torch.device("meta"):
        tower = Qwen2VisionEncoder(tower_cfg)
        parts = {"language": (DecoderLM(lm_cfg), "language.", "model.", "qwen2"),
                 "vision": (tower, "vision.encoder.", "visual.", f"{family}_vision"),
                 "projector": (Projector(tower.out_dim, lm_cfg.hidden_size, "gelu", tower.out_dim),
                               "vision.projector.", "visual.", family)}
    tensors = {}
    for kind, (module, loom_prefix, hf_prefix, family) in parts.items():
        drawn = vlm.random_tensors(module, loom_prefix, seed, lm_cfg.init_std if kind == "language" else None)
        tensors.update(join_fused({n: (hf_name(kind, n, hf_prefix, family), t) for n, t in drawn.items()}, family))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    text = {k: v for k, v in config_to_hf("language", lm_cfg, torch.float32).items() if k != "architectures"}
    architecture = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
    config = {"architectures": [architecture[family]], "model_type": family,
              "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
              "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
              "text_config": dict(text, model_type=f"{family}_text"),
              "vision_config": vision_json(tower_cfg, lm_cfg.hidden_size),
              "tie_word_embeddings": lm_cfg.tie_embeddings, "dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    processor = {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "resample": 3,
                 "size": dict(zip(("shortest_edge", "longest_edge"), PIXELS[family])), "patch_size": 14,
                 "merge_size": 2, "temporal_patch_size": 2, "do_rescale": True, "rescale_factor": 1 / 255,
                 "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True}
    (folder / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict:
    args = vlm.folder_args(__doc__.split("\n\n")[0], "runs/tiny_qwen2vl", argv, tuple(PIXELS))
    model, data = args.out / "model", args.out / "data"
    vocab, ids = write_tokenizer(model)
    write_model(model, vocab, ids, args.seed, args.family)
    counts = vlm.write_splits(data, TASKS, args)
    name = {"qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL (112-pixel windows)"}[args.family]
    print(f"model  {model}: {name} (14-pixel patches, 2×2 merger; Qwen2 with M-RoPE), vocabulary {vocab}, "
          f"<|image_pad|> = {ids['<|image_pad|>']}")
    vlm.print_splits(data, counts)
    return {"model": str(model), "vocab": vocab, "image_token": ids["<|image_pad|>"], "conversations": counts}


if __name__ == "__main__":
    main()
