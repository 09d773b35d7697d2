"""A mixture-of-experts LLM under each layout equals the one-process reference (loom verify: loss, grad norms,
gradients, updates, and the routers' bias after the step's load-balance update), fp32 on gloo CPU ranks.
Experts are replicated over tp and sharded by FSDP2 over dp (× cp); no expert parallelism yet."""

from __future__ import annotations

import pytest
from oracle import assert_all_passed, run_verify

# 8 experts, 2 per token; layer 0 dense, 1-3 sparse; the aux-loss-free bias moves every step; the z-loss on
MOE = ["--model.language.num_experts=8", "--model.language.num_experts_per_tok=2",
       "--model.language.moe_intermediate_size=64", "--model.language.mlp_only_layers=[0]",
       "--model.language.router_bias_update_rate=0.01", "--model.language.router_z_loss_coef=0.001"]
STEPS = 2


def pp(p: int, m: int) -> list[str]:
    return [f"--layout.language.pp={p}", f"--train.microbatches={m}", "--data.tokens_per_microbatch=512"]


LAYOUTS = {
    "dp2": (2, []),
    "tp2-sp": (2, ["--layout.vision.tp=2", "--layout.audio.tp=2", "--layout.language.tp=2",
                   "--layout.language.sequence_parallel=true", "--data.pad_to_multiple=2"]),
    "cp2": (2, ["--layout.language.cp=2", "--data.pad_to_multiple=4"]),
    "pp2": (2, pp(2, 2)),
    # DeepSeek-V3 routing: sigmoid, 4 groups of 2 with the best 2 kept, scaling, a shared expert, first layer dense
    "deepseek-routing-mb2-bins-dp2": (2, ["--model.language.router_score=sigmoid", "--model.language.n_group=4",
                                          "--model.language.topk_group=2", "--model.language.n_shared_experts=1",
                                          "--model.language.routed_scaling_factor=2.5",
                                          "--model.language.first_k_dense_replace=1",
                                          "--train.microbatches=2", "--data.tokens_per_microbatch=512"]),
    # 4 ranks: FSDP2 over dp4, and vision dp4 fanning in to an LLM tp2·dp2
    "dp4": (4, []),
    "fan-in-llm-tp2xdp2": (4, ["--layout.vision.tp=1", "--layout.language.tp=2"]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS, key=lambda name: LAYOUTS[name][0]))
def test_moe_layout_matches_reference(worlds, name):
    world, overrides = LAYOUTS[name]
    assert_all_passed(name, worlds.run(world, run_verify, MOE + overrides, STEPS, timeout=300), STEPS)
