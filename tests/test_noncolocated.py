"""Encoders and the LLM on disjoint ranks equal the one-process reference: loss, grad norms, each module's
gradients and weight updates, on N gloo ranks — the point-to-point bridge (equal, fan-in, fan-out, LLM tp/cp
on the receiving side), the encoder ranks' 1F1B-style loop, and one optimizer step across the grids.
"""

from __future__ import annotations

import pytest
from oracle import assert_all_passed, run_verify


def placed(encoders: str, llm: str, m: int = 2, tokens: int = 512, **degrees: int) -> list[str]:
    """Vision and audio on rank range `encoders`, the LLM on `llm`; `degrees`: e.g. vision_tp=2, language_cp=2."""
    out = [f"--layout.vision.ranks={encoders}", f"--layout.audio.ranks={encoders}", f"--layout.language.ranks={llm}",
           f"--train.microbatches={m}", f"--data.tokens_per_microbatch={tokens}"]
    return out + [f"--layout.{key.replace('_', '.')}={value}" for key, value in degrees.items()]


# (world size, overrides)
LAYOUTS = {
    "vision-tp2-llm-dp2": (4, placed("0-1", "2-3", vision_tp=2)),  # equal: one encoder replica… per LLM replica
    "encoders-dp2-llm-dp1-fan-in": (3, placed("0-1", "2-2")),
    "encoders-dp1-llm-dp2-fan-out-m4": (3, placed("0-0", "1-2", m=4, tokens=256)),
    "llm-cp2-receives": (3, placed("0-0", "1-2", language_cp=2)),
    "llm-tp2-receives": (3, placed("0-0", "1-2", language_tp=2)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_noncolocated_matches_reference(worlds, name):
    world, overrides = LAYOUTS[name]
    per_rank = worlds.run(world, run_verify, overrides, 2, timeout=300)
    assert_all_passed(name, per_rank, 2)
