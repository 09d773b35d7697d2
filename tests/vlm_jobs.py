"""What the whole-folder VLM tests (LLaVA, LLaVA-OneVision, Qwen2-VL) do alike: random PNG files of given sizes,
an example TOML trained two steps and exported, and one trainer step exported and read back by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image


def png_files(root: Path, sizes: list[tuple[int, int]]) -> list[Path]:
    """One random RGB PNG per (H, W) under `root`, named by its size, drawn from one seed."""
    rng = np.random.default_rng(0)
    paths = []
    for h, w in sizes:
        paths.append(root / f"{h}x{w}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    return paths


def train_example_and_export(toml: Path, out: Path, run: Path, hf: Path) -> list[float]:
    """`loom train TOML` for 2 steps on the example folder `out` (model/ and data/ as the make_tiny_* scripts write
    them) into `run`, then `loom export` of step 2 into `hf`; returns the two training losses."""
    import loom.cli

    code = loom.cli.main([
        "train", str(toml), f"--model.hf={out / 'model'}", f"--model.tokenizer={out / 'model'}",
        f"--data.heldout={out / 'data' / 'heldout.jsonl'}",
        f'--data.sources=[{{path = "{out / "data" / "train.jsonl"}", weight = 1.0}}]', "--train.steps=2",
        "--train.global_batch_size=8", f"--run.out_dir={run}", "--run.tensorboard=false", "--run.progress=false",
        "--train.eval_max_new_tokens=2"])
    assert code == 0
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"]
    assert loom.cli.main(["export", str(run / "step-2"), "--hf", str(hf)]) == 0
    return losses


def one_step_exported(trainer, hf: Path, hf_class, folder: Path) -> tuple[object, dict, dict]:
    """One step of `trainer`, its checkpoint exported into `hf` and loaded by
    `hf_class` with no missing, unexpected or mismatched keys: (that model, the folder's tensors, the export's)."""
    import loom.cli
    from safetensors.torch import load_file

    trainer.train_step(trainer.batches.shard(0))
    trainer.checkpoint()
    assert loom.cli.main(["export", str(Path(trainer.cfg.run.out_dir) / "step-1"), "--hf", str(hf)]) == 0
    back, info = hf_class.from_pretrained(hf, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    original, exported = load_file(folder / "model.safetensors"), load_file(hf / "model.safetensors")
    assert exported.keys() == original.keys()
    return back, original, exported

