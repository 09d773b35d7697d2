"""What the whole-folder VLM tests (LLaVA, LLaVA-OneVision, Qwen2-VL, Qwen2-Audio) do alike: an examples/ script
as a module, random PNG files of given sizes, an example TOML trained two steps and exported, and one trainer step
exported and read back by transformers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
from PIL import Image


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(name: str):
    """examples/NAME.py as a module: examples/ is not a package, so loaded from its file, as `python` runs it."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def made_example(name: str, root: Path) -> Path:
    """examples/NAME.py run into `root` with 64 training and 4 held-out conversations: its model/ and data/."""
    example(name).main([str(root), "--train", "64", "--heldout", "4"])
    return root


def loaded_whole(hf_class, folder: Path):
    """`hf_class` read from `folder` with no missing, unexpected or mismatched tensor."""
    model, info = hf_class.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model


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
    back = loaded_whole(hf_class, hf)
    original, exported = load_file(folder / "model.safetensors"), load_file(hf / "model.safetensors")
    assert exported.keys() == original.keys()
    return back, original, exported

