"""A released-model example that needs no download: one tiny random-init Qwen2-Audio folder (its Whisper-style tower
with the pooling, the one-matmul projector, a Qwen2 LLM; its tokenizer, chat template and feature extractor beside
it), written by transformers' save_pretrained, and the built-in tones task written out as WAV clips with a JSONL of
conversations.

    python examples/make_tiny_qwen2audio.py runs/tiny_qwen2audio
    loom train examples/qwen2audio.toml

writes

    OUT/model/  config.json (model_type "qwen2_audio") + model.safetensors, preprocessor_config.json
                (WhisperFeatureExtractor's defaults at 128 mel bins: clips padded to 30 s), tokenizer.json with
                <|AUDIO|> <|audio_bos|> <|audio_eos|>, tokenizer_config.json, Qwen2AudioProcessor's chat template
                (`Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>` per clip)
    OUT/data/   train.jsonl, heldout.jsonl, wav/*.wav

Needs transformers (`pip install -e ".[test]"`). Weights are transformers' initialisation under --seed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # make_tiny_vlm beside this file, however it is loaded
import make_tiny_vlm as vlm  # noqa: E402

TASKS = ["tones"]
AUDIO_TOKENS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
TEXT = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
# Whisper's 128 mel bins and 1500 positions (30 s), as Qwen2-Audio's processor pads every clip to
TOWER = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=256, d_model=64,
             max_source_positions=1500)


def qwen2audio_config(text: dict, tower: dict, audio_token: int):
    from transformers import Qwen2AudioConfig

    return Qwen2AudioConfig(text_config=text, audio_config=tower, audio_token_index=audio_token)


def feature_extractor():
    """Qwen2-Audio's: WhisperFeatureExtractor's defaults at 128 mel bins."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=128)


def save_processor(folder: Path):
    """Qwen2AudioProcessor of the tokenizer in `folder` with the audio tokens added, the feature extractor and its
    default chat template, saved into `folder` (as a released folder holds them); the processor."""
    from transformers import PreTrainedTokenizerFast, Qwen2AudioProcessor

    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": AUDIO_TOKENS})
    processor = Qwen2AudioProcessor(feature_extractor=feature_extractor(), tokenizer=tok)
    processor.save_pretrained(folder)
    return processor


def save_folder(model, folder: Path) -> Path:
    """`model` and the feature extractor's preprocessor_config.json, which loom reads, as one folder."""
    model.save_pretrained(folder)
    feature_extractor().save_pretrained(folder)  # the processor's own save keeps it in processor_config.json only
    return Path(folder)


def write_model(folder: Path, vocab: int, audio_token: int, seed: int) -> None:
    from transformers import Qwen2AudioForConditionalGeneration

    # the embedding rounded up to 64 rows, so tensor parallelism divides it (as released folders pad theirs)
    config = qwen2audio_config(dict(TEXT, vocab_size=-(-vocab // 64) * 64), TOWER, audio_token)
    torch.manual_seed(seed)
    save_folder(Qwen2AudioForConditionalGeneration(config), folder)


def main(argv: list[str] | None = None) -> dict:
    args = vlm.folder_args(__doc__.split("\n\n")[0], "runs/tiny_qwen2audio", argv)
    model, data = args.out / "model", args.out / "data"
    vlm.folder_tokenizer(model, TASKS, [])
    tok = save_processor(model).tokenizer
    vocab, audio_token = len(tok), tok.convert_tokens_to_ids("<|AUDIO|>")
    write_model(model, vocab, audio_token, args.seed)
    counts = vlm.write_splits(data, TASKS, args)
    print(f"model  {model}: Qwen2-Audio (Whisper tower, 128 mel bins, pooled; Qwen2), vocabulary {vocab}, "
          f"<|AUDIO|> = {audio_token}")
    vlm.print_splits(data, counts)
    return {"model": str(model), "vocab": vocab, "audio_token": audio_token, "conversations": counts}


if __name__ == "__main__":
    main()
