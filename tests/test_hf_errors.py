"""Hugging Face interop without `transformers`: bad checkpoints and configs are refused naming the tensor or
key. The folders are loom's own exports (config.json written by hand, tensors by safetensors), which
tests/test_hf.py shows transformers loads exactly; here nothing needs transformers installed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loom.config import ConfigError
from loom.job import load_config
from loom.models.audio import AudioConfig, AudioEncoder
from loom.models.hf import HFError, build_pretrained, config_from_folder, export_module, load_module
from loom.models.llm import DecoderLM, LLMConfig
from loom.models.vision import VisionConfig, VisionEncoder

LLM_SIZES = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)
MODULES = {  # the sizes of tests/test_hf.py's families; export picks llama / qwen2 from attention_bias
    "llama": lambda: DecoderLM(LLMConfig(**LLM_SIZES, head_dim=16, tie_embeddings=False)),
    "qwen2": lambda: DecoderLM(LLMConfig(**LLM_SIZES, attention_bias=True)),
    "siglip": lambda: VisionEncoder(VisionConfig(hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4,
                                                 patch_size=4, position_grid=4)),
    "whisper": lambda: AudioEncoder(AudioConfig(num_features=16, hidden_size=48, num_layers=2, num_heads=4,
                                                intermediate_size=96, max_positions=64)),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family → a Hugging Face folder exported by loom; built once per module, copied before editing."""
    root, made = tmp_path_factory.mktemp("exported"), {}

    def get(family: str) -> Path:
        if family not in made:
            torch.manual_seed(len(made))
            made[family] = export_module(MODULES[family](), root / family)
        return made[family]

    return get


def _copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def _edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_exported_folder_loads_back(exported):
    """The control for every refusal below: the unedited folder loads."""
    lm = build_pretrained(exported("llama"))
    assert lm.cfg.num_layers == 2 and lm.lm_head.weight is not lm.embed_tokens.weight


def test_missing_tensor_is_named(exported, tmp_path):
    folder = _copy(exported("llama"), tmp_path / "m")
    _edit_tensors(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(HFError, match=r"missing tensors \['model\.layers\.1\.mlp\.up_proj\.weight"):
        build_pretrained(folder)


def test_unexpected_tensor_is_named(exported, tmp_path):
    folder = _copy(exported("whisper"), tmp_path / "m")
    _edit_tensors(folder, lambda t: t.update({"layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(HFError, match=r"unexpected tensors \['layers\.0\.extra\.weight'\]"):
        build_pretrained(folder)


def test_shape_mismatch_is_named(exported, tmp_path):
    folder = _copy(exported("siglip"), tmp_path / "m")
    _edit_tensors(folder, lambda t: t.update({"vision_model.encoder.layers.1.mlp.fc1.weight": torch.zeros(95, 48)}))
    with pytest.raises(HFError, match=r"vision_model\.encoder\.layers\.1\.mlp\.fc1\.weight: checkpoint \[95, 48\] "
                                      r"vs loom layers\.1\.mlp\.fc1\.weight \[96, 48\]"):
        build_pretrained(folder)


def test_unsupported_architecture_is_refused(exported, tmp_path):
    folder = _copy(exported("llama"), tmp_path / "m")
    _edit_config(folder, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(HFError, match=r"model_type 'gpt2' \(architectures \['GPT2LMHeadModel'\]\) is not supported"):
        build_pretrained(folder)
    _edit_config(folder, model_type="llama", architectures=["LlamaForSequenceClassification"])
    with pytest.raises(HFError, match=r"architectures \['LlamaForSequenceClassification'\] are not supported"):
        build_pretrained(folder)


@pytest.mark.parametrize(
    "family, changes, message",
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None},
         r"sliding-window attention \(layers \[1\]\)"),
        ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, r"sliding-window attention"),
        ("llama", {"attention_bias": True}, r"attention_bias = true .* o_proj"),
        ("llama", {"hidden_act": "gelu"}, r"hidden_act = 'gelu'"),
        ("llama", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                        "long_factor": [2.0] * 8}},
         r"rope type 'longrope' is not supported"),
        ("siglip", {"hidden_act": "quick_gelu"}, r"hidden_act = 'quick_gelu'"),
        ("whisper", {"activation_function": "relu"}, r"activation_function = 'relu'"),
    ],
    ids=["use_sliding_window", "layer_types", "llama_attention_bias", "hidden_act", "longrope", "siglip_act",
         "whisper_act"],
)
def test_unsupported_config_is_refused(exported, tmp_path, family, changes, message):
    folder = _copy(exported(family), tmp_path / "m")
    build_pretrained(folder)  # unedited, it loads: the edit is what is refused
    _edit_config(folder, **changes)
    with pytest.raises(HFError, match=message):
        build_pretrained(folder)


def test_pickled_only_folder_is_refused_without_unpickling(exported, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(exported("llama") / "config.json", folder)
    (folder / "pytorch_model.bin").write_bytes(b"not even a pickle")  # never opened
    with pytest.raises(HFError, match=r"only pickled weights \['pytorch_model\.bin'\]"):
        build_pretrained(folder)


def test_wrong_module_kind_is_refused(exported):
    cfg = config_from_folder(exported("llama"))
    with torch.device("meta"):
        lm = DecoderLM(cfg)
    with pytest.raises(HFError, match=r"holds the vision model 'siglip_vision_model', not a model for the language"):
        load_module(exported("siglip"), lm)


def test_job_config_errors_name_the_key(exported):
    with pytest.raises(ConfigError, match=r"model\.language\.hf = '/nonexistent/x'.*no config\.json"):
        load_config(None, ["--model.language.hf=/nonexistent/x"])
    with pytest.raises(ConfigError, match=r"model\.audio\.hf = .*holds the vision model .*, not a model for the audio"):
        load_config(None, [f"--model.audio.hf={exported('siglip')}"])


def test_import_does_not_need_transformers():
    code = ("import sys, loom.models.hf, loom.cli, loom.train.trainer; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
