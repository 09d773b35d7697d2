"""A pipelined LLM equals the one-process reference: loss, grad norms, each module's gradients and weight
updates, on N gloo ranks, for every schedule and with TP/SP, CP (packed), DP and the three-phase step
(colocated encoders feeding the LLM's first stage). The reference runs the whole global batch at once.
"""

from __future__ import annotations

import pytest
from oracle import run_verify

UNTIED = ["--model.language.tie_embeddings=false"]  # a tie across stages is not built (rejected by config)


def pp(p: int, m: int, schedule: str = "1f1b", virtual: int = 1, tokens: int = 512) -> list[str]:
    return UNTIED + [f"--layout.language.pp={p}", f"--train.microbatches={m}", f"--data.tokens_per_microbatch={tokens}",
                     f"--parallel.pp_schedule={schedule}", f"--parallel.pp_virtual_stages={virtual}"]


ENCODERS_DP = ["--layout.vision.tp=1", "--layout.audio.tp=1"]

# (world size, overrides); the default model has 4 LLM layers
LAYOUTS = {
    "pp2-1f1b-m2": (2, pp(2, 2)),  # M = pp
    "pp2-1f1b-m4": (2, pp(2, 4, tokens=256)),  # M = 2·pp
    "pp2-gpipe": (2, pp(2, 2, "gpipe")),
    "pp2-interleaved-v2": (2, pp(2, 4, "interleaved_1f1b", 2, tokens=256)),
    "pp2-zero-bubble-v2": (2, pp(2, 4, "zero_bubble", 2, tokens=256)),
    "pp2-zbv": (2, pp(2, 2, "zbv", 2)),
    "pp4-1f1b": (4, pp(4, 4, tokens=256)),
    "pp2xtp2-sp": (4, pp(2, 2) + ["--layout.language.tp=2", "--layout.language.sequence_parallel=true"]),
    "pp2xcp2-packed": (4, pp(2, 2) + ["--layout.language.cp=2"]),
    "pp2xdp2": (4, pp(2, 2) + ENCODERS_DP),
    # the three-phase step: encoders on every rank, their rows to the LLM's stage-0 ranks
    "encoders-dp4-llm-pp2xdp2": (4, pp(2, 4, tokens=256) + ENCODERS_DP),
    "encoders-tp2xdp2-llm-pp2xtp2": (4, pp(2, 2) + ["--layout.vision.tp=2", "--layout.audio.tp=2",
                                                    "--layout.language.tp=2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_matches_reference(worlds, name):
    world, overrides = LAYOUTS[name]
    per_rank = worlds.run(world, run_verify, overrides, 2, timeout=300)
    for rank, steps in enumerate(per_rank):
        assert len(steps) == 2
        for i, s in enumerate(steps):
            where = f"{name} rank {rank} step {i + 1}"
            assert s["ref_norm"] > s["clip"], f"{where}: clipping not active"
            assert s["modules"] == ["audio", "language", "vision"]
            assert s["passed"], f"{where}: {s['failures']}"
        assert steps == per_rank[0], f"{name}: rank {rank} saw other numbers than rank 0"
