"""Multi-head latent attention (DeepSeek-V3's MLA: the query bottleneck, one latent for every head's key and value,
a rotary key shared by the heads, YaRN's mscale on the softmax, interleaved rotary pairs, values narrower than keys)
under each layout equals the one-process reference (loom verify: loss, grad norms, gradients, updates), fp32 on
gloo CPU ranks. Its interop with transformers is tests/test_hf_deepseek.py."""

from __future__ import annotations

import pytest
from oracle import assert_all_passed, run_verify

from loom.job import load_config
from loom.typed_config import ConfigError

MLA = ["--model.language.kv_lora_rank=32", "--model.language.q_lora_rank=48", "--model.language.qk_nope_head_dim=16",
       "--model.language.qk_rope_head_dim=8", "--model.language.v_head_dim=12", "--model.language.num_kv_heads=4",
       "--model.language.rope_interleave=true",
       '--model.language.rope_scaling={rope_type="yarn", factor=4.0, original_max_position_embeddings=64, '
       'mscale=1.0, mscale_all_dim=1.0}']
SP = ["--layout.language.sequence_parallel=true"]
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
