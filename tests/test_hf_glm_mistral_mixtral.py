"""GLM-4.5 (`glm4_moe`: rotary on the first half of each head, q/k/v bias, optional QK-norm, DeepSeek-V3's routing),
Mistral (a Llama without the window) and Mixtral (its mixture under names of its own) interop: a random-init
transformers model saved with `save_pretrained` (no download) loads into loom with the same logits; GLM and Mixtral
export back to the same tensors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_logits_equal_transformers, exported_bit_for_bit, saved_far_from_init

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

from loom.models.hf import build_pretrained  # noqa: E402
from loom.models.hf.mapping import HFError  # noqa: E402

TOL = 1e-5
VOCAB = 272
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24, tie_word_embeddings=False)
GLM = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
           first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.0)
CASES = {
    "glm4-moe-qk-norm-bias": (Glm4MoeConfig, Glm4MoeForCausalLM, {**GLM, "use_qk_norm": True, "attention_bias": True}),
    "glm4-moe-air": (Glm4MoeConfig, Glm4MoeForCausalLM, {**GLM, "use_qk_norm": False, "attention_bias": True}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"sliding_window": None, "num_local_experts": 4,
                                                    "num_experts_per_tok": 2}),
}


def _saved(case: str, folder):
    config, causal_lm, changes = CASES[case]
    model = causal_lm(config(**SIZES, **changes)).eval()
    return saved_far_from_init(model, folder)


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    return _saved(request.param, tmp_path_factory.mktemp(request.param))


def test_logits_equal_transformers(saved):
    ref, folder = saved
    lm = build_pretrained(folder).eval()
    glm = type(ref) is Glm4MoeForCausalLM
    assert (lm.cfg.partial_rotary_factor, lm.cfg.rope_dim) == ((0.5, 12) if glm else (1.0, 24))
    assert lm.cfg.num_experts == {Glm4MoeForCausalLM: 8, MixtralForCausalLM: 4}.get(type(ref), 0)
    assert_logits_equal_transformers(ref, lm, VOCAB, TOL)


@pytest.mark.parametrize("case", ["glm4-moe-qk-norm-bias", "mixtral"])
def test_exports_back_bit_for_bit(tmp_path, case):
    ref, folder = _saved(case, tmp_path / case)
    back = exported_bit_for_bit(folder, tmp_path / "out")
    assert type(back) is type(ref) and back.config.to_dict().get("use_qk_norm") == ref.config.to_dict().get(
        "use_qk_norm")
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref(ids).logits)


def test_glm_without_a_partial_rotary_factor_rotates_half_as_transformers_assumes(tmp_path):
    _, folder = _saved("glm4-moe-air", tmp_path)
    hf = json.loads((folder / "config.json").read_text())
    hf.pop("partial_rotary_factor", None)
    hf["rope_parameters"] = {k: v for k, v in hf["rope_parameters"].items() if k != "partial_rotary_factor"}
    (folder / "config.json").write_text(json.dumps(hf))
    assert build_pretrained(folder).cfg.partial_rotary_factor == 0.5


@pytest.mark.parametrize("case", ["mistral", "mixtral"])
def test_a_mistral_with_its_window_is_refused(tmp_path, case):
    _, folder = _saved(case, tmp_path)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "sliding_window": 16}))
    with pytest.raises(HFError, match=r"sliding-window attention \(layers \[0, 1, 2\]\)"):
        build_pretrained(folder)
