"""A released-model example that needs no download: one tiny random-init LLaVA-OneVision folder (a SigLIP tower, the
MLP projector, the image_newline, a Qwen2 LLM; anyres tiles of its grid pinpoints; its tokenizer, chat template and
image processor beside it), written by transformers' save_pretrained, and the built-in image tasks written out as PNG
files with a JSONL of conversations.

    python examples/make_tiny_onevision.py runs/tiny_onevision
    loom train examples/onevision.toml

writes

    OUT/model/  config.json (model_type "llava_onevision") + model.safetensors, preprocessor_config.json
                (LlavaOnevisionImageProcessor's defaults, its tile and grid pinpoints set for the tiny tower),
                tokenizer.json with <image>, tokenizer_config.json, chat_template.json (as make_tiny_llava.py's)
    OUT/data/   train.jsonl, heldout.jsonl, img/*.png

Needs transformers (`pip install -e ".[test]"`). Weights are transformers' initialisation under --seed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the examples beside this file, however it is loaded
import make_tiny_llava as llava  # noqa: E402
import make_tiny_vlm as vlm  # noqa: E402

TASKS = ["digits", "shapes"]
TILE = 32  # pixels a side of one tile: the tower's image size, 4 × 4 patches of vlm.PATCH
# canvases of 1 or 2 tiles each way; anyres_max_2 pools a 2 × 2 grid's 8 × 8 map (above 1.1 × 2 tiles' worth)
PINPOINTS = [[TILE * i, TILE * j] for i in (1, 2) for j in (1, 2)]
TEXT = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
TOWER = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
             patch_size=vlm.PATCH)


def onevision_config(text: dict, tower: dict, image_token: int, pinpoints: list, max_tiles: int):
    """OneVision's shape: SigLIP read at its last layer with every row kept (the folder's defaults), a Qwen2 LLM."""
    from transformers import LlavaOnevisionConfig, Qwen2Config, SiglipVisionConfig

    return LlavaOnevisionConfig(vision_config=SiglipVisionConfig(**tower), text_config=Qwen2Config(**text),
                                image_token_index=image_token, image_grid_pinpoints=pinpoints,
                                vision_aspect_ratio=f"anyres_max_{max_tiles}")


def image_processor(tile: int, pinpoints: list):
    """LlavaOnevisionImageProcessor's defaults (PIL backend: no torchvision), its tile and canvases set."""
    from transformers import LlavaOnevisionImageProcessorPil

    return LlavaOnevisionImageProcessorPil(size={"height": tile, "width": tile}, image_grid_pinpoints=pinpoints)


def save_folder(model, folder: Path, config) -> Path:
    """`model` and the image processor for its config, as one folder transformers and loom read."""
    model.save_pretrained(folder)
    image_processor(config.vision_config.image_size, config.image_grid_pinpoints).save_pretrained(folder)
    return folder


def write_model(folder: Path, vocab: int, image_token: int, seed: int) -> None:
    from transformers import LlavaOnevisionForConditionalGeneration

    # the embedding rounded up to 64 rows, so tensor parallelism divides it (as released folders pad theirs)
    text = dict(TEXT, vocab_size=-(-vocab // 64) * 64)
    config = onevision_config(text, TOWER, image_token, PINPOINTS, max_tiles=2)
    torch.manual_seed(seed)
    save_folder(LlavaOnevisionForConditionalGeneration(config), folder, config)


def main(argv: list[str] | None = None) -> dict:
    args = vlm.folder_args(__doc__.split("\n\n")[0], "runs/tiny_onevision", argv)
    model, data = args.out / "model", args.out / "data"
    vocab, image_token = llava.write_tokenizer(model)
    write_model(model, vocab, image_token, args.seed)
    counts = vlm.write_splits(data, TASKS, args)
    print(f"model  {model}: LLaVA-OneVision (SigLIP, {TILE}-pixel tiles, canvases {PINPOINTS}; Qwen2), vocabulary "
          f"{vocab}, <image> = {image_token}")
    vlm.print_splits(data, counts)
    return {"model": str(model), "vocab": vocab, "image_token": image_token, "conversations": counts}


if __name__ == "__main__":
    main()
