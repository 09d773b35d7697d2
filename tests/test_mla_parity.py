"""Multi-head latent attention (DeepSeek-V3's MLA: the query bottleneck, one latent for every head's key and value,
a rotary key shared by the heads, YaRN's mscale on the softmax, interleaved rotary pairs, values narrower than keys)
under each layout equals the one-process reference (loom verify: loss, grad norms, gradients, updates), fp32 on
gloo CPU ranks. Its interop with transformers is tests/test_hf_deepseek.py."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_all_passed, run_verify

from loom.job import load_config
from loom.typed_config import ConfigError

MLA = ["--model.language.kv_lora_rank=32", "--model.language.q_lora_rank=48", "--model.language.qk_nope_head_dim=16",
       "--model.language.qk_rope_head_dim=8", "--model.language.v_head_dim=12", "--model.language.num_kv_heads=4",
       "--model.language.rope_interleave=true",
       '--model.language.rope_scaling={rope_type="yarn", factor=4.0, original_max_position_embeddings=64, '
       'mscale=1.0, mscale_all_dim=1.0}']
SP = ["--layout.language.sequence_parallel=true"]
DEEPSEEK_MOE = ["--model.language.num_experts=8", "--model.language.num_experts_per_tok=2",
                "--model.language.moe_intermediate_size=32", "--model.language.first_k_dense_replace=1",
                "--model.language.router_score=sigmoid", "--model.language.n_group=4", "--model.language.topk_group=2",
                "--model.language.n_shared_experts=1", "--model.language.routed_scaling_factor=2.5",
                "--model.language.router_bias_update_rate=0.01"]
LAYOUTS = {
    # the heads split over tp: the shared rotary key's gradient summed over the tp ranks (parallel/tensor.py
    # SharedRotaryKey); under SP the down-projections read the gathered tokens as plain tensors; each block compiled
    # (dynamo + AOTAutograd, eager kernels) around the hook
    "compiled-tp2-sp": (2, ["--layout.language.tp=2", "--data.pad_to_multiple=2", "--train.compile=true",
                            "--train.compile_backend=aot_eager"] + SP),
    # CP gathers keys and values of different widths; cp × tp together on 4 ranks, vision dp4 fanning in
    "cp2xtp2-sp-fan-in": (4, ["--layout.language.cp=2", "--layout.language.tp=2", "--layout.vision.tp=1",
                              "--data.pad_to_multiple=8"] + SP),
    "pp2-1f1b-m2": (2, ["--layout.language.pp=2", "--train.microbatches=2", "--data.tokens_per_microbatch=512"]),
    # DeepSeek-V3 as a whole: latent attention with sigmoid-routed experts in groups and a shared expert, split
    # over ep2 beside tp2 + SP, vision dp4 fanning in
    "deepseek-moe-ep2-tp2-sp-fan-in": (4, DEEPSEEK_MOE + ["--layout.language.ep=2", "--layout.language.tp=2",
                                                          "--layout.vision.tp=1", "--data.pad_to_multiple=2"] + SP),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS, key=lambda name: LAYOUTS[name][0]))
def test_mla_layout_matches_reference(worlds, name):
    world, overrides = LAYOUTS[name]
    assert_all_passed(name, worlds.run(world, run_verify, MLA + overrides, 2, timeout=300), 2)


@pytest.mark.parametrize("overrides, message", [
    (["--model.language.v_head_dim=8"], r"\['model.language.v_head_dim'\] belong to multi-head latent attention"),
    (MLA + ["--model.language.num_kv_heads=2"], r"num_kv_heads = 2 must equal num_heads = 4"),
    (MLA + ["--model.language.v_head_dim=32"], r"v_head_dim = 32 must be ≤ qk_nope_head_dim \+ qk_rope_head_dim = 24"),
    (MLA + ["--model.language.qk_rope_head_dim=7"], r"qk_rope_head_dim = 7 must be even"),
    (MLA + ["--model.language.qk_norm=true"], r"qk_norm has no meaning under multi-head latent attention"),
])
def test_a_latent_attention_config_that_cannot_run_is_refused_by_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def _cp_latent_attention() -> dict:
    """One latent-attention layer on its cp2 share of two samples against the layer on the whole of them: the
    outputs at this rank's tokens, the input gradient there, the weights' gradients summed over cp, and the
    widths of the rows that crossed the cp group."""
    import torch.distributed as dist

    from loom.data.spans import TokenSpans
    from loom.models.latent_attention import LatentAttention
    from loom.models.layers import Rotary
    from loom.models.llm import LLMConfig
    from loom.parallel import context

    cfg = LLMConfig(hidden_size=32, num_heads=4, num_kv_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True)
    torch.manual_seed(0)
    attn, rotary = LatentAttention(cfg), Rotary(cfg.rope_dim, cfg.rope_theta)
    lengths = [8, 12]  # multiples of 2·cp
    x = torch.randn(sum(lengths), 32)
    weight = torch.randn(sum(lengths), 32)  # the loss Σ out · weight reads every output
    positions = torch.cat([torch.arange(n) for n in lengths])
    whole_x = x.clone().requires_grad_()
    (attn(whole_x, rotary(positions, x.dtype), TokenSpans.from_lengths(lengths)) * weight).sum().backward()
    want = {name: p.grad.clone() for name, p in attn.named_parameters()}
    attn.zero_grad()

    group, rank, size = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    order = context.zigzag_order(lengths, size)
    keep = order.view(size, -1)[rank]
    spans = TokenSpans.from_lengths([n // size for n in lengths])
    spans = type(spans)(**{**spans.__dict__, "context": context._context(group, lengths, order, rank, size, "cpu")})
    widths, gather = [], context._GatherTokens.apply
    context._GatherTokens.apply = lambda t, g: widths.append(t.shape[1:]) or gather(t, g)
    try:
        local_x = x[keep].clone().requires_grad_()
        out = attn(local_x, rotary(positions[keep], x.dtype), spans)
        (out * weight[keep]).sum().backward()
    finally:
        context._GatherTokens.apply = gather
    grads = {}
    for name, p in attn.named_parameters():
        dist.all_reduce(p.grad)
        grads[name] = (p.grad - want[name]).abs().max().item()
    whole_out = attn(x, rotary(positions, x.dtype), TokenSpans.from_lengths(lengths)).detach()
    return {"out": (out - whole_out[keep]).abs().max().item(), "input_grad": (local_x.grad - whole_x.grad[keep]).abs()
            .max().item(), "grads": grads, "widths": [list(w) for w in widths]}


def test_cp_gathers_the_latent_not_the_expanded_heads(worlds):
    """Under cp each rank gathers the 16-wide latent and 4-wide rotary key of every token (20 values) — not 4 heads
    of 12-wide keys and 6-wide values (72) — and expands what it reads; exact against the whole sequence."""
    for r in worlds.run(2, _cp_latent_attention):
        assert r["widths"] == [[20]]
        assert r["out"] < 1e-6 and r["input_grad"] < 1e-6, r
        assert max(r["grads"].values()) < 1e-5, r["grads"]
