"""Qwen3-MoE interop: a random-init transformers model saved with `save_pretrained` (no download) loads into
loom with the same logits, and loom exports it back to the same per-expert tensors. transformers 5 fuses the
experts in memory (`gate_up_proj`) and writes them per expert on disk: loom maps the disk's names."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_logits_equal_transformers, exported_bit_for_bit
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from loom.models.hf import HFWeights, build_pretrained, export_module  # noqa: E402
from loom.models.hf.mapping import HFError  # noqa: E402
from loom.models.llm import DecoderLM  # noqa: E402

TOL = 1e-5
# layer 1 dense (mlp_only_layers), layers 0 and 2 sparse; 8 experts, 3 chosen; not renormalised in one case
CONFIG = dict(vocab_size=272, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
              decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False)


@pytest.fixture(scope="module", params=[True, False], ids=["renormalised", "not-renormalised"])
def saved(request, tmp_path_factory):
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG, norm_topk_prob=request.param)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # far from init (the router starts at zero): every tensor changes the logits
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise * 0.15 if p.ndim >= 2 else 1 + noise * 0.1)
    folder = tmp_path_factory.mktemp("qwen3moe")
    model.save_pretrained(folder)
    return model, folder


def test_logits_equal_transformers(saved):
    ref, folder = saved
    lm = build_pretrained(folder).eval()
    c = lm.cfg
    assert (c.num_experts, c.num_experts_per_tok, c.sparse_layers) == (8, 3, [0, 2])
    assert c.norm_topk_prob == ref.config.norm_topk_prob
    assert_logits_equal_transformers(ref, lm, 272, TOL)  # routing is per token: packed samples route alike


def test_disk_has_per_expert_names_and_loom_reads_any_experts_part(saved):
    _, folder = saved
    disk = load_file(folder / "model.safetensors")
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in disk and not any("gate_up" in k for k in disk)
    cfg = build_pretrained(folder).cfg
    with torch.device("meta"):
        lm = DecoderLM(cfg)
    w = HFWeights(folder, lm)
    try:
        part = w.read("layers.2.mlp.experts.gate_proj", (slice(2, 5), slice(8, 16), slice(0, 64)))
        whole = w.read("layers.2.mlp.experts.up_proj")
    finally:
        w.close()
    want = torch.stack([disk[f"model.layers.2.mlp.experts.{e}.gate_proj.weight"][8:16] for e in range(2, 5)])
    assert torch.equal(part, want)
    assert whole.shape == (8, 32, 64)
    assert torch.equal(whole[6], disk["model.layers.2.mlp.experts.6.up_proj.weight"])


def test_export_round_trip_is_exact(saved, tmp_path):
    ref, folder = saved
    back = exported_bit_for_bit(folder, tmp_path / "out")
    assert type(back) is Qwen3MoeForCausalLM and back.config.norm_topk_prob == ref.config.norm_topk_prob
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ref.state_dict().items())


def test_a_router_bias_has_no_qwen3_moe_counterpart(saved, tmp_path):
    _, folder = saved
    lm = build_pretrained(folder)
    lm.cfg.router_bias_update_rate = 1e-3
    with pytest.raises(HFError, match="router_bias_update_rate"):
        export_module(lm, tmp_path / "out")


def test_a_job_keeps_its_training_keys_over_the_folder_and_a_bias_the_folder_lacks_starts_at_zero(saved):
    """The folder says what the model is; how to train it (init, router balancing and losses) is the job's. With
    the bias update on, Qwen3-MoE's routers, which have no selection bias, get one that starts at zero."""
    from loom.job import load_config
    from loom.train.build import build_job

    ref, folder = saved
    cfg = load_config(None, [f"--model.language.hf={folder}", "--model.language.router_bias_update_rate=0.01",
                             "--model.language.router_z_loss_coef=0.002", "--model.language.init_std=0.05",
                             "--model.language.num_experts=4", "--model.encoders=[]", '--data.tasks=["sums"]',
                             "--train.device=cpu"])
    lm = cfg.model.language
    assert (lm.router_bias_update_rate, lm.router_z_loss_coef, lm.init_std) == (0.01, 0.002, 0.05)
    assert lm.num_experts == 8  # an architecture key: the folder's
    gate = build_job(cfg).model.language.layers["2"].mlp.gate
    assert torch.equal(gate.e_score_correction_bias, torch.zeros(8))
    assert torch.equal(gate.weight, ref.model.layers[2].mlp.gate.weight)
