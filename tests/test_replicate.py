"""A replicated module (`[layout.<module>] fsdp = false`: whole weights on each dp·cp rank, gradients all-reduced
once a step in buckets, parallel/replicate.py) equals the one-process reference under the layouts it supports —
alone, beside FSDP2 modules on the same ranks, under tp + SP, cp, microbatches, compile and bf16 — and the
layouts it does not support are refused when the config loads."""

from __future__ import annotations

import pytest
from oracle import assert_all_passed, run_verify

from loom.config import ConfigError
from loom.job import load_config

ENCODERS = ["--layout.vision.fsdp=false", "--layout.audio.fsdp=false"]


def _apart(encoders: str, llm: str) -> list[str]:
    """The encoders on rank range `encoders`, the LLM on `llm` (non-colocated)."""
    return [f"--layout.vision.ranks={encoders}", f"--layout.audio.ranks={encoders}", f"--layout.language.ranks={llm}",
            "--data.tokens_per_microbatch=512"]


ALL = ENCODERS + ["--layout.language.fsdp=false"]
TP2_SP = ["--layout.vision.tp=2", "--layout.audio.tp=2", "--layout.language.tp=2",
          "--layout.language.sequence_parallel=true", "--data.pad_to_multiple=2"]

CASES = {
    # two microbatches: the sums wait for the step's last backward; learned buckets from step 2 on, ~10 KiB each
    # (the tiny model's gradients would fill one 32 MiB bucket): many sums issued while the backward runs
    "all-replicated-dp2-mb2": (2, ALL + ["--train.microbatches=2", "--parallel.replica_bucket_mb=0.01"]),
    # replicated encoders at dp4 fanning in to an FSDP2 LLM at tp2·dp2: both kinds of reduction on the same ranks
    "encoders-replicated-dp4-fan-in-llm-fsdp-tp2": (4, ENCODERS + ["--layout.language.tp=2"]),
    # TP's DTensor shards summed over dp as plain local tensors, SP's partial norms left to TP; the LLM under cp
    "llm-replicated-tp2-sp-dp2": (4, ["--layout.language.fsdp=false"] + TP2_SP),
    "all-replicated-cp2-dp2": (4, ALL + ["--layout.language.cp=2", "--data.pad_to_multiple=4"]),
    # autocast in the replicated modules' forwards, against the fp32 reference at bf16's tolerances
    # bf16 sums (parallel.reduce_dtype): every bucket cast into a flat buffer and back; replica_bucket_mb = 0: one
    # bucket per group, summed after the backward
    # non-colocated: each module's sums over its own ranks' group, the encoder ranks' program switching them on for
    # its last backward (train/encoder_ranks.py), rows and their gradients over the point-to-point bridge
    "noncolocated-encoders-dp2-llm-dp2-all-replicated": (4, ALL + _apart("0-1", "2-3")),
    # the encoders on one rank of their own (nothing to sum), the LLM replicated over the other two: the layout whose
    # replicas let CUDA graphs run on both sides
    "noncolocated-encoders-dp1-llm-replicated-dp2-mb2": (3, ["--layout.language.fsdp=false", *_apart("0-0", "1-2"),
                                                             "--train.microbatches=2"]),
    "bf16-all-replicated-dp2-bins-bf16-sums": (2, ALL + ["--train.dtype=bf16", "--train.microbatches=2",
                                                         "--data.tokens_per_microbatch=512",
                                                         "--parallel.reduce_dtype=bf16",
                                                         "--parallel.replica_bucket_mb=0"]),
}


@pytest.mark.parametrize("name", sorted(CASES, key=lambda name: CASES[name][0]))
def test_replicated_layout_matches_reference(worlds, name):
    world, overrides = CASES[name]
    assert_all_passed(name, worlds.run(world, run_verify, overrides, timeout=300), 3)


GRAPHS = ["--train.compile=true", "--train.compile_mode=reduce-overhead", "--data.tokens_per_microbatch=512"]


def _check(overrides: list[str], world: int = 4):
    return load_config(None, ["--train.global_batch_size=16", "--data.train_size=2000", *overrides], world_size=world)


@pytest.mark.parametrize("overrides, says", [
    (["--layout.language.fsdp=false", "--layout.language.pp=2", "--data.tokens_per_microbatch=512",
      "--train.microbatches=2"], "layout.language.fsdp = false with pp > 1"),
    (["--layout.vision.fsdp=false", *GRAPHS], "train.compile_mode = 'reduce-overhead' with audio sharded by FSDP2"),
    # nothing sharded, but the encoder rank runs a microbatch ahead: graph trees fall off their fast path
    (["--layout.language.fsdp=false", *_apart("0-0", "1-3"), *GRAPHS, "--train.microbatches=2"],
     "train.compile_mode = 'reduce-overhead' with encoders on ranks of their own and train.microbatches = 2"),
])
def test_unsupported_replicas_are_refused_at_load(overrides, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        _check(overrides)


def test_cuda_graphs_allowed_when_every_module_is_replicated():
    cfg = _check(ALL + GRAPHS)
    assert not cfg.layout.language.fsdp and cfg.train.compile_mode == "reduce-overhead"


def test_cuda_graphs_allowed_with_the_encoders_on_one_rank_of_their_own_and_the_llm_replicated():
    cfg = _check(["--layout.language.fsdp=false", *_apart("0-0", "1-3"), *GRAPHS])
    assert cfg.layout.language.ranks == "1-3" and cfg.train.compile_mode == "reduce-overhead"


def _sums_taken_in(overrides: list[str]) -> list[str]:
    """On a dp2 world, every module replicated: the dtype each GradientSum sums in (None: the gradients' own)."""
    import torch
    from conftest import TINY_MODEL_OVERRIDES

    from loom.data.tokenizer import ByteTokenizer
    from loom.parallel.replicate import gradient_sums
    from loom.train.build import build_job_model, setup_parallel

    cfg = load_config(None, [*TINY_MODEL_OVERRIDES, "--train.device=cpu", *ALL, *overrides], world_size=2)
    model = build_job_model(cfg, ByteTokenizer())
    setup_parallel(model, cfg, torch.device("cpu"))
    return [str(s.reduce_dtype) for s in gradient_sums(model)]


@pytest.mark.parametrize("overrides, dtype", [
    ([], "None"),
    (["--train.dtype=bf16"], "torch.float32"),
    (["--train.dtype=bf16", "--parallel.reduce_dtype=bf16"], "torch.bfloat16"),
])
def test_sums_take_fsdp2_s_reduce_dtype(worlds, overrides, dtype):
    """One GradientSum for the three modules on the same ranks, in the dtype FSDP2 would reduce in."""
    assert worlds.run(2, _sums_taken_in, overrides) == [[dtype]] * 2
