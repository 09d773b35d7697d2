"""A mixture-of-experts LLM under each layout equals the one-process reference (loom verify: loss, grad norms,
gradients, updates, and the routers' bias after the step's load-balance update), fp32 on gloo CPU ranks.
Experts are replicated over tp and sharded by FSDP2 over dp (× cp), or split over ep ranks of dp×cp and sharded
by FSDP2 over the rest (parallel/experts.py); the faults below show verify sees expert gradients."""

from __future__ import annotations

import pytest
from oracle import assert_all_passed, run_verify

# 8 experts, 2 per token; layer 0 dense, 1-2 sparse; the aux-loss-free bias moves every step; the z-loss on.
# A smaller LLM and batch than the default: 4 layouts stay under a minute on CI's 2 cores.
MOE = ["--model.language.num_layers=3", "--model.language.hidden_size=64", "--model.language.intermediate_size=128",
       "--model.language.num_experts=8", "--model.language.num_experts_per_tok=2",
       "--model.language.moe_intermediate_size=32", "--model.language.mlp_only_layers=[0]",
       "--model.language.router_bias_update_rate=0.01", "--model.language.router_z_loss_coef=0.001",
       "--model.language.router_seq_aux_loss_coef=0.01",
       "--train.global_batch_size=8"]
STEPS = 2
TOKENS = "--data.tokens_per_microbatch=256"
# DeepSeek-V3 routing: sigmoid, 4 groups of 2 with the best 2 kept, scaling, a shared expert, first layer dense
DEEPSEEK = ["--model.language.router_score=sigmoid", "--model.language.n_group=4", "--model.language.topk_group=2",
            "--model.language.n_shared_experts=1", "--model.language.routed_scaling_factor=2.5",
            "--model.language.first_k_dense_replace=1"]

LAYOUTS = {
    # M = 2 bins of T tokens each, filler included (not counted): the bias update equals the reference's one batch
    "cp2-mb2-deepseek-routing": (2, ["--layout.language.cp=2", "--train.microbatches=2", TOKENS] + DEEPSEEK),
    # blocks recomputed in backward: counts not doubled (compile: tests/test_moe_block.py, one process, cheaper)
    "tp2-sp-ac-full": (2, ["--layout.vision.tp=2", "--layout.audio.tp=2", "--layout.language.tp=2",
                           "--layout.language.sequence_parallel=true", "--data.pad_to_multiple=2",
                           "--train.activation_checkpointing=full"]),
    "pp2-1f1b-m2": (2, ["--layout.language.pp=2", "--train.microbatches=2", TOKENS]),
    # expert parallel: 8 experts over ep ranks of the LLM's dp×cp, FSDP2 over the dp×cp/ep others
    "ep2-dp4": (4, ["--layout.language.ep=2"]),  # efsdp 2: expert gradients summed by the all-to-all and FSDP2
    "ep4-cp2xdp2": (4, ["--layout.language.ep=4", "--layout.language.cp=2", "--data.pad_to_multiple=4"]),
    # each layer's exchange in chunks whose all-to-alls overlap the experts (parallel/expert_chunks.py): 2, and 3
    # (chunk i+2's dispatch queued behind chunk i's combine)
    "ep2-dp4-chunks2": (4, ["--layout.language.ep=2", "--parallel.ep_chunks=2"]),
    "ep4-cp2xdp2-chunks3": (4, ["--layout.language.ep=4", "--layout.language.cp=2", "--data.pad_to_multiple=4",
                                "--parallel.ep_chunks=3"]),
    # each tp coordinate its own EP group (experts replicated over tp); vision dp4 fans in to LLM dp2
    "ep2-tp2-sp-fan-in": (4, ["--layout.language.ep=2", "--layout.language.tp=2", "--layout.vision.tp=1",
                              "--layout.language.sequence_parallel=true", "--data.pad_to_multiple=2"]),
    # encoders on ranks 0-1 of their own, the LLM dp2·ep2 on 2-3 (point-to-point bridge)
    "ep2-non-colocated": (4, ["--layout.language.ep=2", '--layout.language.ranks="2-3"',
                              '--layout.vision.ranks="0-1"', '--layout.audio.ranks="0-1"']),
    "ep2-pp2xdp2": (4, ["--layout.language.ep=2", "--layout.language.pp=2", "--train.microbatches=2", TOKENS,
                        "--layout.vision.tp=1", "--layout.audio.tp=1"]),  # each stage its own EP group
    # GLM-4.5's shape: rotary on the first half of each head, q/k/v bias and QK-norm, DeepSeek-V3's routing; cp×tp
    "glm-cp2xtp2-sp": (4, DEEPSEEK + ["--model.language.partial_rotary_factor=0.5", "--model.language.qk_norm=true",
                                      "--model.language.attention_bias=true", "--layout.language.cp=2",
                                      "--layout.language.tp=2", "--layout.language.sequence_parallel=true",
                                      "--data.pad_to_multiple=8"]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS, key=lambda name: LAYOUTS[name][0]))
def test_moe_layout_matches_reference(worlds, name):
    world, overrides = LAYOUTS[name]
    assert_all_passed(name, worlds.run(world, run_verify, MOE + overrides, STEPS, timeout=300), STEPS)


def _verify_with_expert_gradients_averaged(overrides: list[str], steps: int) -> list[dict]:
    """FSDP2's default for the experts' unit: gradients averaged over efsdp instead of summed (the dense
    weights' sum over dp×cp): expert gradients end efsdp× too small, pytorch #160285's bug."""
    import loom.parallel.language as language
    from torch.distributed.fsdp import FSDPModule

    from loom.models.experts import Experts

    apply_fsdp = language.apply_fsdp

    def averaging(module, *args, **kwargs):
        apply_fsdp(module, *args, **kwargs)
        for m in module.modules():
            if isinstance(m, Experts) and isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(float(m._get_fsdp_state()._fsdp_param_group.mesh_info.mesh.size()))

    language.apply_fsdp = averaging
    try:
        return run_verify(overrides, steps)
    finally:
        language.apply_fsdp = apply_fsdp


def test_expert_gradients_averaged_over_efsdp_fail_verify(worlds):
    per_rank = worlds.run(4, _verify_with_expert_gradients_averaged, MOE + ["--layout.language.ep=2"], 1, timeout=300)
    failures = per_rank[0][0]["failures"]
    assert any("language gradients" in f for f in failures), failures
    assert not any(f.startswith(("step 1: vision", "step 1: audio")) for f in failures), failures


def _verify_skewed(overrides: list[str], steps: int) -> list[dict]:
    """Every token chooses experts 0 and 1 — all on EP rank 0 — through a large choice bias set at start-up
    (on the reference too): the other EP ranks receive no token and still take part in every collective."""
    from loom.models.router import Router

    reset = Router.reset_buffers

    def skewed(self):
        reset(self)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias[:2] = 100.0

    Router.reset_buffers = skewed
    try:
        return run_verify(overrides, steps)
    finally:
        Router.reset_buffers = reset


def test_skewed_routing_to_one_ep_rank(worlds):
    skew = ["--layout.language.ep=2", "--model.language.router_bias=true", "--model.language.router_bias_update_rate=0"]
    per_rank = worlds.run(4, _verify_skewed, MOE + skew, STEPS, timeout=300)
    assert_all_passed("ep2-skewed", per_rank, STEPS)
