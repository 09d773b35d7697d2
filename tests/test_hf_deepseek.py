"""DeepSeek-V2/V3 interop: multi-head latent attention (with and without the query bottleneck, rotary pairs
interleaved or in halves, YaRN with DeepSeek's mscale), V3's sigmoid-routed experts with their selection bias and
V2's softmax-routed ones (over all experts, or within the best groups by their best expert). A random-init
transformers model saved with `save_pretrained` (no download) loads into loom with the same logits, and loom
exports it back to the same tensors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_logits_equal_transformers, exported_bit_for_bit, saved_far_from_init
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)

from loom.models.hf import HFWeights, build_pretrained, export_module  # noqa: E402
from loom.models.hf.mapping import HFError  # noqa: E402
from loom.models.llm import DecoderLM  # noqa: E402

TOL = 1e-5
VOCAB = 272
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
            v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.0, tie_word_embeddings=False,
            max_position_embeddings=64)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.8}
V3 = (DeepseekV3Config, DeepseekV3ForCausalLM)
V2 = (DeepseekV2Config, DeepseekV2ForCausalLM)
CASES = {  # DeepSeek-V3's own shape of attention; Moonlight's (no query bottleneck); rotary halves, no scaling
    "v3-q-lora-interleaved-yarn": (V3, dict(q_lora_rank=24, rope_interleave=True, rope_scaling=YARN)),
    "v3-no-q-lora-interleaved": (V3, dict(q_lora_rank=None, rope_interleave=True)),
    "v3-q-lora-halves-bias": (V3, dict(q_lora_rank=24, rope_interleave=False, attention_bias=True)),
    # DeepSeek-V2: 2 groups, a token's experts in the best one; V2-Lite: no query bottleneck, top-k over all
    "v2-group-limited-yarn": (V2, dict(q_lora_rank=24, topk_method="group_limited_greedy", rope_scaling=YARN)),
    "v2-lite-greedy": (V2, dict(q_lora_rank=None, topk_method="greedy", n_group=None, topk_group=None)),
}


def _saved(case: str, folder):
    (config, causal_lm), changes = CASES[case]
    model = causal_lm(config(**{**BASE, **changes})).eval()
    return saved_far_from_init(model, folder)


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    return _saved(request.param, tmp_path_factory.mktemp("deepseek"))


def test_logits_equal_transformers(saved):
    ref, folder = saved
    lm = build_pretrained(folder).eval()
    c = lm.cfg
    assert (c.kv_lora_rank, c.q_lora_rank, c.num_experts, c.sparse_layers) == (
        16, ref.config.q_lora_rank or 0, 8, [1, 2])
    assert_logits_equal_transformers(ref, lm, VOCAB, TOL)


def test_export_round_trip_is_exact(saved, tmp_path):
    ref, folder = saved
    back = exported_bit_for_bit(folder, tmp_path / "out")
    assert type(back) is type(ref)
    assert back.config.q_lora_rank == ref.config.q_lora_rank
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref(ids).logits)


def test_multi_token_prediction_layers_are_skipped_and_other_quantizations_refused(tmp_path):
    """DeepSeek-V3's folders hold a layer after the last (its multi-token-prediction module)."""
    _, folder = _saved("v3-q-lora-interleaved-yarn", tmp_path / "v3")
    tmp_path = tmp_path / "edited"
    tmp_path.mkdir()
    tensors = load_file(folder / "model.safetensors")
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight": torch.ones(64)}
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 1}))
    lm = build_pretrained(tmp_path)
    assert lm.cfg.num_layers == 3
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 0}))
    with pytest.raises(HFError, match="unexpected tensors.*layers.3.eh_proj"):
        build_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(HFError, match="quantization .*'awq'.* is not supported"):
        build_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "scoring_func": "softmax"}))
    with pytest.raises(HFError, match="scoring_func"):
        build_pretrained(tmp_path)


def test_routing_keys_transformers_does_not_read_are_refused(tmp_path):
    _, folder = _saved("v2-lite-greedy", tmp_path)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "topk_method": "noaux_tc"}))
    with pytest.raises(HFError, match=r"topk_method = 'noaux_tc' is not supported"):
        build_pretrained(folder)


def test_a_layout_of_routing_no_deepseek_config_says_is_refused_on_export(tmp_path):
    lm = build_pretrained(_saved("v2-group-limited-yarn", tmp_path / "v2")[1])
    lm.cfg.router_group_score = "top2_sum"  # V2 scores a group by its best expert
    with pytest.raises(HFError, match=r"'router_group_score': 'top2_sum'.*DeepSeek-V2"):
        export_module(lm, tmp_path / "out")


def _quantized(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek's block-wise fp8: (float8 weight, one factor per block, the dequantized weight) — each element
    times the factor at [row // block, col // block]."""
    rows, cols = w.shape
    factors = torch.empty(-(-rows // block), -(-cols // block))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(factors.shape[0]):
        for j in range(factors.shape[1]):
            part = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            factors[i, j] = part.abs().max() / 448  # float8_e4m3fn's largest value
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (part / factors[i, j]).to(q.dtype)
    return q, factors, q.float() * factors[torch.arange(rows)[:, None] // block, torch.arange(cols)[None] // block]


def test_an_fp8_folder_is_read_dequantized_a_box_at_a_time(tmp_path):
    """DeepSeek-V3 ships its Linear weights in float8 with a factor per 128 × 128 block (here 16 × 16, so the last
    blocks are cut short: 88, 40, 24 rows or columns): loom reads each weight times its blocks' factors, also a box
    that starts inside a block, and the stacked experts' boxes."""
    _, folder = _saved("v3-q-lora-interleaved-yarn", tmp_path / "v3")
    tensors, stored, want = load_file(folder / "model.safetensors"), {}, {}
    for name, w in tensors.items():
        if name.endswith("proj.weight"):  # every Linear but the embedding, the head and the routers
            stored[name], stored[name + "_scale_inv"], want[name] = _quantized(w, 16)
        else:
            stored[name] = want[name] = w
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    save_file(stored, fp8 / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((folder / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**hf, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}}))
    lm = build_pretrained(fp8)
    exported = load_file(export_module(lm, tmp_path / "out") / "model.safetensors")
    assert exported.keys() == want.keys()
    assert all(torch.equal(exported[k], v) for k, v in want.items())
    assert not torch.equal(want["model.layers.0.self_attn.kv_b_proj.weight"],
                           tensors["model.layers.0.self_attn.kv_b_proj.weight"])  # fp8 rounds: the read is not a copy
    with torch.device("meta"):
        meta = DecoderLM(lm.cfg)
    w = HFWeights(fp8, meta)
    try:
        part = w.read("layers.0.self_attn.kv_b_proj.weight", (slice(5, 37), slice(3, 15)))
        experts = w.read("layers.2.mlp.experts.up_proj", (slice(2, 5), slice(3, 30), slice(7, 50)))
    finally:
        w.close()
    assert torch.equal(part, want["model.layers.0.self_attn.kv_b_proj.weight"][5:37, 3:15])
    assert torch.equal(experts, torch.stack([want[f"model.layers.2.mlp.experts.{e}.up_proj.weight"][3:30, 7:50]
                                             for e in range(2, 5)]))
