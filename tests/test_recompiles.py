"""torch.compile without recompiles: with a token budget (`data.tokens_per_microbatch`) every shape and
constant a compiled block or the loss sees is fixed, so a compiled run compiles nothing after its first step,
although its microbatches differ in sample count, lengths and encoder items.

What recompiles is decided by dynamo's guards, whatever the backend; these runs use "aot_eager"
(`train.compile_backend`: dynamo + AOTAutograd, no inductor code generation) to keep CPU time low.
bench/mm_bench.py reports the same count (`recompiles`) for the real backend on GPU.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from conftest import tiny_job_overrides

from loom.job import load_config
from loom.parallel.compile import row_budgets

COMPILE = ["--train.compile=true", "--train.compile_backend=aot_eager"]
# B = 5 samples in 2 microbatches of 256 tokens: bins of 1–3 samples, 0–3 images and 0–2 clips each
FIXED = [*COMPILE, "--train.global_batch_size=5", "--train.microbatches=2", "--data.tokens_per_microbatch=256"]
# padded: every LLM microbatch [2 rows, 48 tokens]; samples over 48 tokens skipped, so some microbatches hold one
# sample and a filler row
PADDED = [*COMPILE, "--train.global_batch_size=4", "--train.microbatches=2", "--data.format=bshd",
          "--data.padded_length=48", "--data.too_long=skip"]
STEPS = 5


@contextlib.contextmanager
def recompile_log():
    """Dynamo's recompile reasons collected; undone afterwards (test worlds are reused)."""
    reasons: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: reasons.append(" | ".join(record.getMessage().splitlines()[:3]))
    guards = logging.getLogger("torch._dynamo.guards")
    torch._dynamo.reset()  # nothing compiled by an earlier test counts or serves this run
    torch._logging.set_logs(recompiles=True)
    guards.addHandler(handler)
    try:
        yield reasons
    finally:
        guards.removeHandler(handler)
        torch._logging.set_logs()


def compiled_run(out_dir: str, overrides: list[str], steps: int = STEPS) -> dict:
    """`steps` compiled training steps of the tiny model; what compiled after the first, and what the
    microbatches held (real samples per LLM microbatch, items per encoder call)."""
    from loom.job import load_config
    from loom.data.batch import IGNORE_INDEX
    from loom.parallel.compile import compiled_frames
    from loom.train.step_data import step_inputs
    from loom.train.trainer import Trainer

    world = dist.get_world_size() if dist.is_initialized() else None
    with recompile_log() as reasons:
        cfg = load_config(None, tiny_job_overrides(out_dir, *overrides), world_size=world)
        trainer = Trainer(cfg)
        shapes, llm_shapes, first, logged = [], set(), 0, 0
        for step in range(steps):
            inputs = step_inputs(trainer.batches, step, trainer.plan, cfg, trainer.tok, trainer.counters,
                                 trainer.device)
            for m in inputs.microbatches:
                lay = m.llm.spans  # packed: segments (the filler one too); padded: rows with labels (samples)
                lengths = lay.cu_seqlens.diff() if lay.pad_mask is None else (m.llm.labels != IGNORE_INDEX).sum(1)
                shapes.append((sum(1 for n in lengths.tolist() if n),
                               *(len(items) for items in m.encoder_items.values())))
                llm_shapes.add(tuple(m.llm.input_ids.shape))
            loss = trainer.train_step().loss
            if step == 0:
                first, logged = compiled_frames(), len(reasons)
        return {"recompiles": compiled_frames() - first, "reasons": reasons[logged:], "shapes": shapes,
                "llm_shapes": sorted(llm_shapes), "first_step_frames": first, "loss": loss}


def check_fixed(result: dict) -> None:
    assert result["first_step_frames"] > 0, "nothing was compiled: the test would prove nothing"
    assert result["recompiles"] == 0 and not result["reasons"], result["reasons"]
    for column in zip(*result["shapes"]):  # segments, vision items, audio items: each took several values
        assert len(set(column)) > 1, result["shapes"]


def test_fixed_shapes_compile_nothing_after_the_first_step(tmp_path):
    check_fixed(compiled_run(str(tmp_path), FIXED))


def test_padded_rows_of_fixed_length_compile_nothing_after_the_first_step(tmp_path):
    """bshd: every microbatch [R, S] (R = 4 / M 2, S = data.padded_length), filler rows where skips left one
    sample; the encoders' row budget is R·S."""
    result = compiled_run(str(tmp_path), PADDED)
    check_fixed(result)
    assert result["llm_shapes"] == [(2, 48)]


def test_without_a_token_budget_the_count_sees_recompiles(tmp_path):
    """The control: the same run with packed lengths rounded to 64 instead of T recompiles, so the counter
    (frames dynamo compiled) does see what the fixed run avoids."""
    result = compiled_run(str(tmp_path), [*COMPILE, "--train.global_batch_size=5"])
    assert result["recompiles"] > 0 and result["reasons"]


def test_fixed_shapes_on_two_ranks(worlds, tmp_path):
    """dp 2 under FSDP2: each rank gets its own bins, and neither compiles after the first step (3 steps: each
    rank's bins already vary in samples and items by then)."""
    for result in worlds.run(2, compiled_run, str(tmp_path), FIXED, 3, timeout=900):
        check_fixed(result)


def test_row_budgets_by_hand():
    """Each encoder's fixed rows per call with T = 100 tokens per LLM microbatch and B = 8 samples: T times the
    LLM microbatches one encoder call serves, rounded up to 64 under encoder SP; an explicit count wins. Encoders
    without a [layout.<name>] table of their own take the default layout (a None layout crashed this once)."""
    budget = ["--data.tokens_per_microbatch=100", "--train.global_batch_size=8"]

    def rows(overrides: list[str], world_size: int) -> dict[str, tuple[int, int]]:
        cfg = load_config(None, budget + overrides, world_size=world_size)
        return {n: (b.rows, b.items) for n, b in row_budgets(cfg, world_size).items()}

    assert rows([], 1) == {"vision": (100, 8), "audio": (100, 8)}
    assert rows([], 4) == {"vision": (100, 8), "audio": (100, 8)}  # dp4 everywhere: one replica serves one
    # vision tp4 = dp1 feeds the LLM's 4 replicas: 400 rows, 448 under SP; audio (no table) stays dp4
    assert rows(["--layout.vision.tp=4"], 4) == {"vision": (400, 8), "audio": (100, 8)}
    assert rows(["--layout.vision.tp=4", "--layout.vision.sequence_parallel=true"], 4)["vision"] == (448, 8)
    assert rows(["--layout.vision.tp=2", "--layout.vision.sequence_parallel=true",
                 "--data.encoder_rows_per_microbatch.vision=130"], 4)["vision"] == (192, 8)


def test_cuda_graphs_for_every_block_with_coarse_encoder_rows(monkeypatch):
    """train.compile_mode = 'reduce-overhead' reaches every block: the LLM's with fixed shapes, the encoders' with
    static rows rounded up to a quarter of their budget (a graph per row count met: at most 4); it needs inductor
    and a token budget, else a config error names what is missing."""
    import pytest

    from loom.config import ConfigError
    from loom.models.encoder_layer import ROW_MULTIPLE, run_packed
    from loom.models.multimodal import build_model
    from loom.parallel.compile import compile_blocks, graph_multiple

    graphs = ["--train.compile=true", "--train.compile_mode=reduce-overhead", "--data.tokens_per_microbatch=2048"]
    cfg = load_config(None, graphs)
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.setdefault(fn.__self__.__class__.__name__, kw) and fn)
    m = cfg.model
    model = build_model(m.language, m.vision, m.audio, {"vision": 5, "audio": 6})
    for name, module in model.named_children():
        if name in ("language", *cfg.model.encoders):
            compile_blocks(name, module, cfg)
    assert seen.pop("DecoderLayer") == {"backend": "inductor", "dynamic": None, "mode": "reduce-overhead"}
    # encoders: static rows, one compile per bucket met (test_graph_buckets_compile_static_rows_once_each)
    assert seen and all(kw["mode"] == "reduce-overhead" and kw["dynamic"] is False for kw in seen.values())
    budget = model.vision.encoder.row_budget
    assert (budget.rows, budget.multiple) == (2048, 512) and ROW_MULTIPLE == 64  # T = 2048: quarters of 512
    assert graph_multiple(8192) == 2048 and graph_multiple(100) == 64 and graph_multiple(1000) == 256
    rows = []  # what the layers see: 300 + 500 rows rounded up to 1,024, the filler dropped after them
    out = run_packed(torch.randn(800, 4), [300, 500], [lambda h, spans: rows.append((h.shape[0], spans)) or h * 2],
                     budget)
    assert [n for n, _ in rows] == [1024] and out.shape == (800, 4)
    # the 224 filler rows as 8 segments of 28 (its attention 8·28² instead of 224²), then empty ones up to a fixed
    # count: room for every item of the global batch, and 8 pieces
    bounds = rows[0][1].bounds
    assert bounds[:11] == (0, 300, 800, *range(828, 1025, 28)) and set(bounds[11:]) == {1024}
    assert len(bounds) == cfg.train.global_batch_size + 8 + 1
    small = type(budget)(rows=100, items=4, multiple=1024)  # a filler of 724 rows > 100: still fits
    seen_spans = []
    run_packed(torch.randn(300 // 3, 4), [100], [lambda h, spans: seen_spans.append(spans) or h], small)
    assert seen_spans[0].max_seqlen == 1024
    for missing in (["--data.tokens_per_microbatch=0"], ["--train.compile_backend=aot_eager"]):
        with pytest.raises(ConfigError, match="compile_mode"):
            load_config(None, graphs + missing)


def test_graph_buckets_compile_static_rows_once_each():
    """Encoder rows under CUDA graphs (`encoder_dynamic(True, "reduce-overhead")`): each row bucket met compiles
    once with every size a constant (inductor's reductions over rows then have fixed sizes), a bucket met again
    compiles nothing; without graphs the rows stay symbolic, one graph for every count."""
    import torch.nn as nn

    from loom.models.encoder_layer import RowBudget, run_packed
    from loom.parallel.compile import compiled_frames, encoder_dynamic

    class Block(nn.Module):  # a LayerNorm and a biased linear: the reductions over rows the ViT's backward does
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.proj = nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, h, spans):
            return h + self.proj(self.norm(h))

    for mode, graphs in (("reduce-overhead", 2), (None, 1)):
        torch._dynamo.reset()
        symbolic = []

        def backend(gm, example_inputs, symbolic=symbolic):
            symbolic.append(any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and not all(
                isinstance(d, int) for d in x.shape)) for x in example_inputs))
            return gm.forward

        blocks = [Block(), Block()]
        for block in blocks:
            block.forward = torch.compile(block.forward, backend=backend, dynamic=encoder_dynamic(True, mode))
        budget = RowBudget(rows=2048, items=4, multiple=512)
        frames = [compiled_frames()]
        for lengths in ([300, 500], [200], [100, 700, 100]):  # buckets 1,024, then 512, then 1,024 again
            h = torch.randn(sum(lengths), 8, requires_grad=True)
            run_packed(h, lengths, blocks, budget).sum().backward()
            frames.append(compiled_frames())
        # one compile for both blocks (shared code) per bucket under graphs, one in all without; none on the third
        assert [b - a for a, b in zip(frames, frames[1:])] == ([1, 1, 0] if mode else [1, 0, 0])
        assert symbolic == ([False] * graphs if mode else [True])
