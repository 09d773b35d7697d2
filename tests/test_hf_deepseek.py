"""DeepSeek-V3 interop: multi-head latent attention (with and without the query bottleneck, rotary pairs
interleaved or in halves, YaRN with DeepSeek's mscale) and its sigmoid-routed experts. A random-init transformers
model saved with `save_pretrained` (no download) loads into loom with the same logits, and loom exports it back to
the same tensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from loom.data.spans import TokenSpans  # noqa: E402
from loom.models.hf import build_pretrained, export_module  # noqa: E402
from loom.models.hf.mapping import HFError  # noqa: E402

TOL = 1e-5
VOCAB = 272
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
            v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.0, tie_word_embeddings=False,
            max_position_embeddings=64)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.8}
CASES = {  # DeepSeek-V3's own shape of attention; Moonlight's (no query bottleneck); rotary halves, no scaling
    "q-lora-interleaved-yarn": dict(q_lora_rank=24, rope_interleave=True, rope_scaling=YARN),
    "no-q-lora-interleaved": dict(q_lora_rank=None, rope_interleave=True),
    "q-lora-halves-bias": dict(q_lora_rank=24, rope_interleave=False, attention_bias=True),
}


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**BASE, **CASES[request.param])).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # far from init (the router starts at zero): every tensor changes the logits
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise * 0.15 if p.ndim >= 2 else 1 + noise * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    folder = tmp_path_factory.mktemp("deepseek")
    model.save_pretrained(folder)
    return model, folder


def test_logits_equal_transformers(saved):
    ref, folder = saved
    lm = build_pretrained(folder).eval()
    c = lm.cfg
    assert (c.kv_lora_rank, c.q_lora_rank, c.num_experts, c.sparse_layers) == (
        16, ref.config.q_lora_rank or 0, 8, [1, 2])
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        got = lm(ids, torch.arange(24).expand(2, 24), TokenSpans())
    assert want.abs().max() > 1.0
    assert (got - want).abs().max() <= TOL
    lengths = [7, 13, 4]  # packed samples: positions restart, attention stays inside each
    samples = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    with torch.no_grad():
        got = lm(torch.cat(samples), torch.cat([torch.arange(n) for n in lengths]), TokenSpans.from_lengths(lengths))
        want = torch.cat([ref(s[None]).logits[0] for s in samples])
    assert (got - want).abs().max() <= TOL


def test_export_round_trip_is_exact(saved, tmp_path):
    ref, folder = saved
    out = export_module(build_pretrained(folder), tmp_path / "out")
    original, exported = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    back = AutoModelForCausalLM.from_pretrained(out)
    assert type(back) is DeepseekV3ForCausalLM
    assert back.config.rope_interleave == ref.config.rope_interleave
    assert back.config.q_lora_rank == ref.config.q_lora_rank
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref(ids).logits)


def test_multi_token_prediction_layers_are_skipped_and_fp8_folders_refused(saved, tmp_path):
    """DeepSeek-V3's folders hold a layer after the last (its multi-token-prediction module) and fp8 weights."""
    _, folder = saved
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
    (tmp_path / "config.json").write_text(json.dumps({**hf, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(HFError, match="quantized weights.*fp8"):
        build_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "scoring_func": "softmax"}))
    with pytest.raises(HFError, match="scoring_func"):
        build_pretrained(tmp_path)
