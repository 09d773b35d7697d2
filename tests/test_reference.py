"""The reference policy (loom/rl/reference.py, `train.reference`): a second set of this rank's shards, swapped
in for a scoring pass and back bit for bit; its logprobs become the `ref_logprobs` field GRPO's KL reads, and
`loom verify` passes with it on tp, cp, pp and non-colocated layouts (steps after the first measure a KL
that is not zero)."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_all_passed

import loom.data.source
from loom.rl.reference import ReferencePolicy


def test_a_swap_and_back_restores_the_trained_weights_bit_for_bit(tiny_model):
    initial = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    reference = ReferencePolicy(tiny_model, 1.0)
    with torch.no_grad():
        for p in tiny_model.parameters():  # "training": every weight moves
            p.add_(torch.randn_like(p) * 1e-3)
    trained = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    reference.swap()
    for n, p in tiny_model.named_parameters():
        assert torch.equal(p, initial[n]), n
    reference.swap()
    for n, p in tiny_model.named_parameters():
        assert torch.equal(p, trained[n]), n


def _verify_with_reference(overrides: list[str]) -> list[dict]:
    """GRPO with KL against the initial policy; the data brings no ref_logprobs: the reference scores them."""
    from test_grpo import _verify_grpo

    return _verify_grpo(["--train.reference=initial", "--train.grpo.kl_beta=0.5", *overrides], False)


def placed(encoders: str, llm: str) -> list[str]:
    return [f"--layout.vision.ranks={encoders}", f"--layout.audio.ranks={encoders}", f"--layout.language.ranks={llm}"]


BUDGET = ["--train.microbatches=2", "--data.tokens_per_microbatch=512"]
LAYOUTS = {
    "tp2": (2, ["--layout.vision.tp=2", "--layout.audio.tp=2", "--layout.language.tp=2"]),
    "cp2-mb2": (2, ["--layout.language.cp=2", *BUDGET]),
    "pp2": (2, ["--layout.language.pp=2", *BUDGET]),
    "noncolocated-llm-dp2": (3, placed("0-0", "1-2") + BUDGET),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_grpo_against_the_initial_reference_verifies(worlds, name):
    world, overrides = LAYOUTS[name]
    assert_all_passed(name, worlds.run(world, _verify_with_reference, overrides, timeout=300), 2)


def test_the_reference_is_the_initial_policy_at_step_one_and_not_after(tmp_path):
    """At step 1 the policy is the reference: KL exactly 0; after an update it is not."""
    from conftest import tiny_job_overrides

    from loom.job import load_config
    from loom.train.trainer import Trainer

    from test_grpo import _with_rl_fields

    plain = loom.data.source.to_sample
    loom.data.source.to_sample = _with_rl_fields(plain, reference_values=False)
    try:
        cfg = load_config(None, tiny_job_overrides(tmp_path, "--train.objective=grpo", "--train.reference=initial",
                                                   "--train.grpo.kl_beta=0.5", "--data.workers=0"))
        trainer = Trainer(cfg)
        first, second = trainer.train_step(), trainer.train_step()
    finally:
        loom.data.source.to_sample = plain
    assert first.metrics["kl"] == 0 and second.metrics["kl"] > 0
