"""Issue 51's three workloads, where a layout per module should beat one layout for the whole model: each a data
shape, a model shape, and its candidate layouts as named config override sets (bench/mm_bench.py --workload NAME
--layout ROW; bench/run_layouts.sh runs a workload's rows, each with its `loom verify`).

Layout names: `one-…` is the one-layout alternative, `loom-…` loom's per-module layout. A one-mesh trainer puts
every module on the LLM's mesh; loom cannot run an encoder with cp, or with pp on the LLM's ranks, so `one-…` gives
the encoder the LLM's dp and folds the LLM's cp·pp·tp into the encoder's tp. That is at least as fast for the
encoder as what a one-mesh trainer does (every cp rank encoding all its samples' images; the encoder on stage 0
alone), so a ratio measured against it understates loom's advantage.

Every workload has a 4-GPU form and a CPU form (`small`: 2 gloo ranks, the tiny model, the same layout structure).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.shapes import LLMS, VIT
from bench.workload import SMALL, Shape

# the vision encoder alone (the workloads are about one encoder against the LLM), with the built-in image tasks as
# loom's data (what `loom verify` trains on; the bench brings its own samples)
VISION_ONLY = ["--model.encoders=[\"vision\"]", "--data.tasks=[\"digits\",\"shapes\"]"]
SMALL_MODEL = ["--model.vision.patch_size=4"]
# loom verify's ViT on GPUs: the 0.4B ViT's widths and heads (what its tp must divide), 4 layers, the built-in tasks'
# small images at patch 4
VIT_VERIFY = [*VIT, "--model.vision.num_layers=4", "--model.vision.patch_size=4", "--model.vision.position_grid=8"]


@dataclass(frozen=True)
class LayoutWorkload:
    name: str
    what: str
    shape: Shape  # 4 GPUs
    model: list[str]  # the model's shape (bench/shapes.py overrides)
    seq: int  # tokens per GPU per step the samples are packed into (bench/workload.py)
    per_gpu: int  # samples per GPU per step
    layouts: dict[str, list[str]]  # row name → overrides, on 4 GPUs
    small_shape: Shape = SMALL
    small_seq: int = 256
    small_per_gpu: int = 2
    small_layouts: dict[str, list[str]] = field(default_factory=dict)  # the same rows' structure on 2 CPU ranks
    # loom verify on the GPUs runs the layout with a model whose fp32 reference fits one GPU: these sizes
    verify_model: list[str] = field(default_factory=list)

    def rows(self, small: bool) -> dict[str, list[str]]:
        return self.small_layouts if small else self.layouts


def _lay(module: str, **dims) -> list[str]:
    return [f"--layout.{module}.{k}={v}" for k, v in dims.items()]


def _mt(m: int, t: int) -> list[str]:
    return [f"--train.microbatches={m}", f"--data.tokens_per_microbatch={t}"]


def _pp(p: int, m: int, t: int) -> list[str]:
    return [*_lay("language", pp=p), "--parallel.pp_schedule=1f1b", *_mt(m, t)]


# ---------------------------------------------------------------- 1. long multimodal context: the LLM needs cp

LONG_CONTEXT = LayoutWorkload(
    "long-context", "32K-token samples with 16–32 video-like frames each; the LLM at cp4 or cp2·dp2",
    Shape(image_px=(224, 336), text=(4096, 14000), audio_every=0, images=16, images_max=32),
    [*LLMS["1.5b"], *VIT, *VISION_ONLY], seq=32768, per_gpu=1,
    layouts={  # 4 samples per step; T = one sample
        "one-cp4": [*_lay("language", cp=4), *_lay("vision", tp=4), *_mt(4, 32768)],
        "one-cp2dp2": [*_lay("language", cp=2), *_lay("vision", tp=2), *_mt(2, 32768)],
        "loom-cp4": [*_lay("language", cp=4), *_mt(4, 32768)],  # vision dp4, fan-in to the cp ranks
        "loom-cp2dp2": [*_lay("language", cp=2), *_mt(2, 32768)],
    },
    small_shape=Shape(patch=4, image_px=(16, 24), text=(64, 128), audio_every=0, images=4, images_max=6),
    small_seq=256, small_per_gpu=1,
    small_layouts={"one-cp2": [*_lay("language", cp=2), *_lay("vision", tp=2), *_mt(2, 256)],
                   "loom-cp2": [*_lay("language", cp=2), *_mt(2, 256)]},
    verify_model=[*LLMS["1.5b"], "--model.language.num_layers=4", *VIT_VERIFY],
)

# ---------------------------------------------------------------- 2. a pipelined 7B-class LLM after the 0.4B ViT

QWEN2_5_7B = ["--model.language.hidden_size=3584", "--model.language.num_layers=28", "--model.language.num_heads=28",
              "--model.language.num_kv_heads=4", "--model.language.intermediate_size=18944",
              "--model.language.vocab_size=152064", "--model.language.attention_bias=true",
              "--model.language.rope_theta=1000000.0", "--model.language.tie_embeddings=false"]

PIPELINED = LayoutWorkload(
    "pipelined", "a Qwen2.5-7B-shaped LLM at pp4 or pp2·dp2 after the 0.4B ViT, 4 images per sample",
    Shape(image_px=(224, 336), text=(64, 1024), audio_every=0, images=4),
    [*QWEN2_5_7B, *VIT, *VISION_ONLY], seq=8192, per_gpu=2,
    layouts={  # 8 samples per step, one per microbatch at pp4
        "one-pp4": [*_pp(4, 8, 4096), *_lay("vision", tp=4)],
        "one-pp2dp2": [*_pp(2, 4, 4096), *_lay("vision", tp=2)],
        "loom-pp4": _pp(4, 8, 4096),  # the three-phase step: vision dp4 over every rank
        "loom-pp2dp2": _pp(2, 4, 4096),
    },
    small_shape=Shape(patch=4, image_px=(16, 24), text=(8, 32), audio_every=0, images=3),
    small_seq=256, small_per_gpu=2,
    small_layouts={"one-pp2": [*_pp(2, 4, 128), *_lay("vision", tp=2)], "loom-pp2": _pp(2, 4, 128)},
    verify_model=[*QWEN2_5_7B, "--model.language.num_layers=4", *VIT_VERIFY],
)

# ---------------------------------------------------------------- 3. encoder-heavy: encoders on GPUs of their own


def _apart(enc: str, llm: str) -> list[str]:
    return [f"--layout.vision.ranks={enc}", f"--layout.language.ranks={llm}"]


ENCODER_HEAVY = LayoutWorkload(
    "encoder-heavy", "8 images per sample and a 0.5B LLM; the ViT on GPUs of its own, a microbatch ahead",
    Shape(image_px=(224, 336), text=(64, 1024), audio_every=0, images=8),
    [*LLMS["0.5b"], *VIT, *VISION_ONLY], seq=24576, per_gpu=3,
    layouts={  # 12 samples per step: 3 per LLM replica at dp4, 4 at dp3, 6 at dp2
        "one-dp4": _mt(2, 16384),
        "one-tp2dp2": [*_lay("language", tp=2, sequence_parallel="true"), *_lay("vision", tp=2),
                       "--data.pad_to_multiple=2", *_mt(2, 24576)],
        "loom-enc1-dp3": [*_apart("0-0", "1-3"), *_mt(2, 16384)],
        "loom-enc2-dp2": [*_apart("0-1", "2-3"), *_mt(4, 16384)],
    },
    small_shape=Shape(patch=4, image_px=(16, 24), text=(8, 32), audio_every=0, images=4),
    small_seq=256, small_per_gpu=2,
    small_layouts={"one-dp2": _mt(2, 256), "loom-enc1-dp1": [*_apart("0-0", "1-1"), *_mt(2, 256)]},
    verify_model=[*LLMS["0.5b"], "--model.language.num_layers=4", *VIT_VERIFY],
)

WORKLOADS = {w.name: w for w in (LONG_CONTEXT, PIPELINED, ENCODER_HEAVY)}


def workload_overrides(name: str, layout: str, small: bool) -> list[str]:
    """The model and the layout of one row, as loom overrides (a ValueError naming the choices otherwise)."""
    if name not in WORKLOADS:
        raise ValueError(f"--workload {name!r}: choose one of {sorted(WORKLOADS)}")
    w = WORKLOADS[name]
    rows = {**w.rows(small), "custom": []}  # custom: the layout from mm_bench's --set alone (plan_validate_gpu)
    if layout not in rows:
        raise ValueError(f"--layout {layout!r} is not a row of workload {name!r}{' (--small)' if small else ''}: "
                         f"choose one of {sorted(rows)}")
    return [*(SMALL_MODEL + VISION_ONLY if small else w.model), *rows[layout]]


def verify_overrides(name: str, layout: str, small: bool) -> list[str]:
    """`loom verify`'s overrides for one row: its layout in fp32 on the workload's verify model (the tiny one on
    CPU), with the built-in image tasks as data; M and T from the row, T raised to hold a built-in sample."""
    w = WORKLOADS[name]
    model = SMALL_MODEL + VISION_ONLY if small else [*w.verify_model, *VISION_ONLY]
    rows = [o for o in w.rows(small)[layout] if not o.startswith("--data.tokens_per_microbatch=")]
    pp = any(o.startswith("--layout.language.pp=") for o in rows)
    fixed = ["--data.tokens_per_microbatch=512"] if pp else []  # pipelines need fixed shapes; 0 elsewhere
    return [*model, *rows, *fixed, "--train.dtype=fp32", "--train.global_batch_size=24"]


def main(argv: list[str] | None = None) -> int:
    """For bench/run_layouts.sh: `rows WORKLOAD [--small]` prints the row names, `verify WORKLOAD ROW [--small]`
    the row's `loom verify` overrides, one a line."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.layout_workloads")
    p.add_argument("what", choices=("rows", "verify"))
    p.add_argument("workload", choices=tuple(WORKLOADS))
    p.add_argument("row", nargs="?", default="")
    p.add_argument("--small", action="store_true")
    args = p.parse_args(argv)
    if args.what == "rows":
        print("\n".join(WORKLOADS[args.workload].rows(args.small)))
        return 0
    try:
        workload_overrides(args.workload, args.row, args.small)  # the same check and message as mm_bench's
    except ValueError as e:
        p.error(str(e))
    print("\n".join(verify_overrides(args.workload, args.row, args.small)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
