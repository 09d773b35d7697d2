"""A user-data example that needs no download: a tiny random Qwen2 + SigLIP pair, a BPE chat tokenizer, and the
built-in tasks written out as image / audio files with a JSONL of conversations.

    python examples/make_tiny_vlm.py runs/tiny_vlm
    loom train examples/jsonl.toml

writes

    OUT/llm/        Qwen2ForCausalLM folder (config.json + model.safetensors), random init
    OUT/vision/     SiglipVisionModel folder, random init, + preprocessor_config.json (mean, std, patch)
    OUT/tokenizer/  tokenizer.json (byte-level BPE) + tokenizer_config.json (ChatML chat template)
    OUT/data/       train.jsonl, heldout.jsonl, img/*.png, wav/*.wav

The audio encoder has no folder: loom initialises it from the job's seed. The LLM's vocabulary is the
tokenizer's without the media placeholders (<|image_pad|>, <|audio_pad|>): loom adds those and grows the
embedding. Everything is a function of --seed; held-out conversations come from the tasks' held-out split,
so no held-out image or clip is ever trained on.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from loom.data import tasks as T
from loom.models.hf.export import write_hf_folder
from loom.models.hf.load import expected_tensors
from loom.models.init import initial_value
from loom.models.llm import DecoderLM, LLMConfig
from loom.models.vision import VisionConfig, VisionEncoder

PATCH = 8
WAV_RATE = 16_000  # what loom's audio loader would resample to anyway: written at it, nothing to redo
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB = 1000  # an upper bound: this small corpus runs out of merges near 420
CHAT_TEMPLATE = (  # Qwen2.5's ChatML without its default system prompt and tools
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# a few phrasings per task, so the prompt is text to read and not one fixed token string
PROMPTS = {
    "digits": ("What digit is this?", "Which number is written here?", "Read the handwritten digit."),
    "shapes": ("What shape is this?", "Name the colour and the shape.", "Describe the shape in the picture."),
    "tones": ("Which tones do you hear?", "List the tones from first to last.", "Name the tones in this clip."),
}
SYSTEM_WORDS = ["system", "user", "assistant", "You are a helpful assistant."]


def llm_config(vocab_size: int) -> LLMConfig:
    # attention_bias: q/k/v biases, which is what makes the export a Qwen2 folder (mapping.llm_family)
    return LLMConfig(vocab_size=vocab_size, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     intermediate_size=352, tie_embeddings=True, attention_bias=True, rope_theta=10000.0)


def vision_config() -> VisionConfig:
    # position grid 6: image_size 48, the largest task image (shapes: 6 patches a side)
    return VisionConfig(patch_size=PATCH, hidden_size=96, num_layers=2, num_heads=4, intermediate_size=384,
                        position_grid=max(T.SHAPE_SIDE_MULTIPLES), act="tanh")


# ---------------------------------------------------------------- models


def random_tensors(module: torch.nn.Module, prefix: str, seed: int, llm_std: float | None) -> dict:
    """Every tensor the (meta) module's checkpoint holds, drawn as loom draws it when a module has no folder
    (models/init.py, by (seed, one-process name)): the folder is the weights loom itself would start from."""
    out = {}
    for name, shape in expected_tensors(module).items():
        owner, _, attr = name.rpartition(".")
        out[name] = initial_value(prefix + name, module.get_submodule(owner), attr, torch.Size(shape), seed,
                                  torch.device("cpu"), llm_std)
    return out


def write_models(out: Path, vocab_size: int, seed: int) -> tuple[LLMConfig, VisionConfig]:
    lm_cfg, vis_cfg = llm_config(vocab_size), vision_config()
    with torch.device("meta"):
        lm, vis = DecoderLM(lm_cfg), VisionEncoder(vis_cfg)
    write_hf_folder("language", lm_cfg, random_tensors(lm, "language.", seed, lm_cfg.init_std), out / "llm")
    write_hf_folder("vision", vis_cfg, random_tensors(vis, "vision.encoder.", seed, None), out / "vision")
    # SigLIP's own normalisation (0.5, 0.5): images.ImageRule.of reads mean and std from here
    pre = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "patch_size": PATCH, "do_rescale": True,
           "rescale_factor": 1 / 255, "do_normalize": True}
    (out / "vision" / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    return lm_cfg, vis_cfg


# ---------------------------------------------------------------- tokenizer


def answers(task: str) -> list[str]:
    if task == "digits":
        return list(T.DIGIT_WORDS)
    if task == "shapes":
        return [f"{c} {s}" for c in T.COLOUR_NAMES for s in T.SHAPE_NAMES]
    return list(T.TONE_NAMES) + [" ".join(T.TONE_NAMES)]


def write_tokenizer(out: Path, task_names: list[str]) -> int:
    """A byte-level BPE over every prompt and answer the data can hold; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # as Qwen2's: offsets keep their spaces
    tok.decoder = decoders.ByteLevel()
    # every byte in the alphabet, so any text (not only this corpus) still encodes
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, min_frequency=1, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = SYSTEM_WORDS + [text for t in task_names for text in (*PROMPTS[t], *answers(t))]
    tok.train_from_iterator(corpus, trainer)
    folder = out / "tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 32768,
              "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.get_vocab_size(with_added_tokens=True)


def folder_tokenizer(folder: Path, task_names: list[str], added: list[str]):
    """write_tokenizer's BPE inside a released model's `folder`, as such a folder holds its tokenizer, with the
    family's special tokens `added`; the tokenizers.Tokenizer, saved."""
    from tokenizers import AddedToken, Tokenizer

    write_tokenizer(folder.parent, task_names)
    folder.mkdir(parents=True, exist_ok=True)
    for path in (folder.parent / "tokenizer").iterdir():
        path.replace(folder / path.name)
    (folder.parent / "tokenizer").rmdir()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    tok.save(str(folder / "tokenizer.json"))
    return tok


# ---------------------------------------------------------------- data


def to_png(image: torch.Tensor, path: Path) -> None:
    """A normalised [3, H, W] task image → an RGB PNG, min-max over the whole image (keeps colour ratios)."""
    x = image.numpy()
    x = (x - x.min()) / max(float(x.max() - x.min()), 1e-6)
    Image.fromarray(np.round(x.transpose(1, 2, 0) * 255).astype(np.uint8), "RGB").save(path)


def to_wav(wave: np.ndarray, rate: int, path: Path) -> None:
    import soundfile
    from scipy.signal import resample_poly

    if rate != WAV_RATE:
        wave = resample_poly(wave, WAV_RATE, rate)  # polyphase: exact integer ratio, deterministic
    soundfile.write(path, np.clip(wave, -1.0, 1.0), WAV_RATE, subtype="PCM_16")


def prompt_for(task: str, split: str, index: int, seed: int) -> str:
    # crc32, not hash(): the same choice in every Python process
    choice = zlib.crc32(f"{seed}:{task}:{split}:{index}".encode())
    return PROMPTS[task][choice % len(PROMPTS[task])]


def write_split(data: Path, split: str, size: int, task_names: list[str], seed: int) -> dict[str, int]:
    """`size` conversations of the tasks' `split`, item i being example i // k of task i % k (TaskDataset's
    order); returns how many of each task."""
    counts = dict.fromkeys(task_names, 0)
    lines = []
    for i in range(size):
        task, index = task_names[i % len(task_names)], i // len(task_names)
        if task == "tones":
            wave, rate, answer = T.tone_wave(split, index, seed=seed)
            media = {"type": "audio", "path": f"wav/{split}-{i:06d}.wav"}
            to_wav(wave, rate, data / media["path"])
        else:
            # n_audio_features is unused by image tasks; patch_size sets the image sides in whole patches
            ex = T.make_example(task, split, index, seed=seed, patch_size=PATCH, n_audio_features=1)
            answer = ex.answer
            media = {"type": "image", "path": f"img/{split}-{i:06d}.png"}
            to_png(ex.images[0], data / media["path"])
        user = [media, {"type": "text", "text": prompt_for(task, split, index, seed)}]
        lines.append({"task": task, "messages": [{"role": "user", "content": user},
                                   {"role": "assistant", "content": [{"type": "text", "text": answer}]}]})
        counts[task] += 1
    (data / f"{split}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return counts


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="output folder (e.g. runs/tiny_vlm)")
    p.add_argument("--train", type=int, default=2000, help="training conversations")
    p.add_argument("--heldout", type=int, default=120, help="held-out conversations")
    p.add_argument("--seed", type=int, default=0, help="data and initial weights are a function of it")
    p.add_argument("--tasks", default="digits,shapes,tones", help=f"comma-separated, some of {list(T.TASKS)}")
    args = p.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in args.tasks if t not in T.TASKS]
    if unknown or not args.tasks:
        p.error(f"--tasks: unknown {unknown}; choose some of {list(T.TASKS)}")
    if args.train < 1 or args.heldout < 1:
        p.error("--train and --heldout must be at least 1")
    return args


def folder_args(description: str, example_out: str, argv: list[str] | None,
                families: tuple[str, ...] = ()) -> argparse.Namespace:
    """The arguments of the whole-folder examples (make_tiny_llava.py, make_tiny_qwen2vl.py, …); `families`: the
    model_types a script can write (the first by default)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("out", type=Path, help=f"output folder (e.g. {example_out})")
    if families:
        p.add_argument("--family", choices=families, default=families[0], help="config.json's model_type")
    p.add_argument("--train", type=int, default=1000, help="training conversations")
    p.add_argument("--heldout", type=int, default=80, help="held-out conversations")
    p.add_argument("--seed", type=int, default=0, help="data and initial weights are a function of it")
    return p.parse_args(argv)


def write_splits(data: Path, task_names: list[str], args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """The train and held-out conversations (`args.train`, `args.heldout`) under `data`: each split's counts."""
    for sub in {"wav" if t == "tones" else "img" for t in task_names}:  # the tones task's clips, the others' images
        (data / sub).mkdir(parents=True, exist_ok=True)
    return {split: write_split(data, split, n, task_names, args.seed)
            for split, n in (("train", args.train), ("heldout", args.heldout))}


def print_splits(data: Path, counts: dict[str, dict[str, int]]) -> None:
    for split, c in counts.items():
        print(f"data   {data / (split + '.jsonl')}: {sum(c.values())} conversations {c}")


def main(argv: list[str] | None = None) -> dict:
    """Writes everything; returns what it wrote (paths, sizes), which it also prints."""
    args = parse_args(argv)
    out: Path = args.out
    data = out / "data"
    for sub in ("img", "wav"):
        (data / sub).mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(out, args.tasks)
    lm_cfg, vis_cfg = write_models(out, vocab, args.seed)
    counts = {split: write_split(data, split, n, args.tasks, args.seed)
              for split, n in (("train", args.train), ("heldout", args.heldout))}
    with torch.device("meta"):  # shapes only
        modules = {"llm": DecoderLM(lm_cfg), "vision": VisionEncoder(vis_cfg)}
    n_params = {name: sum(int(np.prod(s)) for s in expected_tensors(m).values()) for name, m in modules.items()}
    summary = {"out": str(out), "tokenizer_vocab": vocab, "params": n_params, "conversations": counts}
    print(f"tokenizer  {out / 'tokenizer'}: byte-level BPE, {vocab} tokens (placeholders not included)")
    print(f"llm        {out / 'llm'}: Qwen2, hidden {lm_cfg.hidden_size}, {lm_cfg.num_layers} layers, "
          f"{n_params['llm']:,} parameters")
    print(f"vision     {out / 'vision'}: SigLIP, patch {vis_cfg.patch_size}, hidden {vis_cfg.hidden_size}, "
          f"{vis_cfg.num_layers} layers, {n_params['vision']:,} parameters")
    for split, c in counts.items():
        print(f"data       {data / (split + '.jsonl')}: {sum(c.values())} conversations {c}")
    return summary


if __name__ == "__main__":
    main()
