"""The objective seam: an objective written once — here a toy one, the SFT loss counted twice on every other
target of the samples that carry an image, marked by a per-token field — trains under every kind of step
(plain, three-phase, non-colocated pipelined; the non-colocated loop is test_grpo's) and `loom verify` finds
each equal to the one-process reference trained with the same objective. The field travels through packing, CP
sharding, the pipeline's microbatch table and the bridges' placements without the step naming it; shard it one
token off the labels and verify fails (`test_a_misplaced_field_fails`)."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_all_passed, run_verify

import loom.data.source
from loom.data.batch import IGNORE_INDEX
from loom.train.loss import loss_function

FIELD = "doubled"


class DoubledOnImages:
    """Σ CE over the targets, plus Σ CE again over those whose `doubled` field is 1; over the global supervised
    count. Built as two summed cross-entropies, so vocab-sharded logits need nothing special."""

    def __init__(self, compile_backend: str | None, how) -> None:
        self.token_loss = loss_function(compile_backend, how.vocab_sharded)

    def loss_sum(self, logits: torch.Tensor, batch) -> torch.Tensor:
        again = batch.labels.where(batch.fields[FIELD] > 0, IGNORE_INDEX)
        return self.token_loss(logits, batch.labels) + self.token_loss(logits, again)

    def normaliser(self, inputs) -> int:
        return max(1, inputs.supervised)


def _with_field(to_sample):
    """`to_sample` whose samples carry the field: 1 on every other target of a sample with an image."""

    def make(example, tok, counters):
        sample = to_sample(example, tok, counters)
        flags = [0.0] * len(sample)
        if sample.images:
            for i in range(len(sample) - 1):
                if sample.supervised[i + 1] and i % 2 == 0:  # label i is token i + 1
                    flags[i] = 1.0
        sample.token_fields = {FIELD: flags}
        return sample

    return make


def _misplaced_fields(shard):
    """A fault in CP sharding: each rank's share of the fields one token off its share of the labels."""

    def sharded(batch, group, placeholder_ids):
        local, selectors = shard(batch, group, placeholder_ids)
        local.fields = {name: values.roll(1) for name, values in local.fields.items()}
        return local, selectors

    return sharded


def _verify_with_objective(overrides: list[str], fault: bool = False) -> list[dict]:
    import loom.train.runners as runners
    import loom.train.verify as verify

    plain, original, shard = loom.data.source.to_sample, verify.verify, runners.shard_for_context
    loom.data.source.to_sample = _with_field(plain)
    verify.verify = lambda *a, **k: original(*a, **k, objective=DoubledOnImages)
    if fault:
        runners.shard_for_context = _misplaced_fields(shard)
    try:
        return run_verify(overrides, 2)
    finally:
        loom.data.source.to_sample, verify.verify, runners.shard_for_context = plain, original, shard


def placed(encoders: str, llm: str) -> list[str]:
    return [f"--layout.vision.ranks={encoders}", f"--layout.audio.ranks={encoders}", f"--layout.language.ranks={llm}"]


BUDGET = ["--train.microbatches=2", "--data.tokens_per_microbatch=512"]
# (world size, overrides): one of each kind of step, with tp (loss parallel) and cp (the field sharded) in them;
# the non-colocated loop with its LLM under cp carries GRPO's advantages in tests/test_grpo.py
LAYOUTS = {
    "plain-fan-in-llm-cp2": (4, ["--layout.vision.tp=1", "--layout.language.cp=2", "--data.pad_to_multiple=4"]),
    "three-phase-llm-pp2xtp2": (4, ["--layout.language.pp=2", "--layout.language.tp=2", *BUDGET]),
    "noncolocated-pipelined-llm-pp2": (3, placed("0-0", "1-2") + ["--layout.language.pp=2", *BUDGET]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_an_objective_written_once_verifies_under_every_step(worlds, name):
    world, overrides = LAYOUTS[name]
    per_rank = worlds.run(world, _verify_with_objective, overrides, timeout=300)
    assert_all_passed(name, per_rank, 2)


def test_a_misplaced_field_fails(worlds):
    """CP sharding that puts each rank's fields one token off its labels: the layout trains another objective
    than the reference, and verify names the loss."""
    world, overrides = LAYOUTS["plain-fan-in-llm-cp2"]
    per_rank = worlds.run(world, _verify_with_objective, overrides, True, timeout=300)
    for rank, steps in enumerate(per_rank):
        assert not steps[0]["passed"], f"rank {rank}: the misplaced field passed: {steps[0]['quantities']}"
        assert any("loss" in f for f in steps[0]["failures"]), steps[0]["failures"]
