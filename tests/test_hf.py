"""Hugging Face interop: tiny random models built with `transformers` (no download) load into loom with the
same outputs, and loom exports back to identical tensors. Every test here needs transformers; the refusals,
which do not, are in tests/test_hf_errors.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    SiglipConfig,
    SiglipModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SiglipVisionConfig,
    SiglipVisionModel,
    WhisperConfig,
    WhisperForConditionalGeneration,
)
from transformers.models.whisper.modeling_whisper import WhisperEncoder  # noqa: E402

import loom.cli  # noqa: E402
from loom.job import load_config  # noqa: E402
from loom.data.spans import TokenSpans  # noqa: E402
from loom.models.hf import HFWeights, build_pretrained, config_from_folder, export_module, load_module  # noqa: E402
from loom.models.layers import rope_inv_freq  # noqa: E402
from loom.models.llm import DecoderLM  # noqa: E402
from loom.models.vision import VisionEncoder  # noqa: E402
from loom.train.trainer import Trainer  # noqa: E402

TOL = 1e-5
LLM_SIZES = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
LLMS = {
    # GQA, untied, llama3 rope scaling with a short original context so a 48-token sequence goes past it
    "llama": (LlamaForCausalLM, LlamaConfig(
        **LLM_SIZES, head_dim=16, tie_word_embeddings=False, max_position_embeddings=128,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    # tied embeddings, q/k/v bias, linear rope scaling
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(
        **LLM_SIZES, tie_word_embeddings=True, rope_parameters={"rope_type": "linear", "rope_theta": 1000.0,
                                                                "factor": 4.0})),
    # QK-norm, head_dim × heads ≠ hidden_size, YaRN (its attention factor scales cos and sin) past an original 16
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(
        **LLM_SIZES, head_dim=24, tie_word_embeddings=False, max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16})),
}
SIGLIP = SiglipVisionConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                            image_size=16, patch_size=4)
WHISPER = WhisperConfig(d_model=48, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=96, num_mel_bins=16,
                        max_source_positions=64, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=96,
                        vocab_size=100, max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        decoder_start_token_id=1)
SIGLIP_FULL = SiglipConfig(  # text + vision towers: loom takes the vision tower
    vision_config=SIGLIP.to_dict(),
    text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=50,
                     max_position_embeddings=8, pad_token_id=0, bos_token_id=1, eos_token_id=2))
FAMILIES = {**LLMS, "siglip": (SiglipVisionModel, SIGLIP), "siglip_full": (SiglipModel, SIGLIP_FULL),
            "whisper": (WhisperForConditionalGeneration, WHISPER)}


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights far from their init (norm scales ≠ 1, biases ≠ 0) so every tensor changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim >= 2:
                p.copy_(noise * 0.15)
            elif name.endswith("bias"):
                p.copy_(noise * 0.1)
            else:
                p.copy_(1 + noise * 0.1)
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """family → (HF model in eval mode, its save_pretrained folder); built once per module."""
    root, made = tmp_path_factory.mktemp("hf"), {}

    def get(family: str):
        if family not in made:
            cls, cfg = FAMILIES[family]
            model = _randomize(cls(cfg), seed=len(made)).eval()
            model.save_pretrained(root / family)
            made[family] = (model, root / family)
        return made[family]

    return get


def _logits(lm: DecoderLM, ids: torch.Tensor, positions: torch.Tensor, layout: TokenSpans) -> torch.Tensor:
    with torch.no_grad():
        return lm(ids, positions, layout)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# ---------------------------------------------------------------- same outputs


@pytest.mark.parametrize("family", list(LLMS))
def test_llm_logits_match_hf(hf, family):
    ref_model, folder = hf(family)
    lm = build_pretrained(folder).eval()
    c = lm.cfg
    assert (c.num_heads, c.num_kv_heads, c.attention_bias, c.qk_norm) == (4, 2, family == "qwen2", family == "qwen3")
    assert (lm.lm_head.weight is lm.embed_tokens.weight) == (family == "qwen2")
    ids = torch.randint(0, 272, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_model(ids).logits
    ours = _logits(lm, ids, torch.arange(24).expand(2, 24), TokenSpans())
    assert ref.abs().max() > 1.0  # outputs far from zero: the tolerance is meaningful
    assert _max_diff(ours, ref) <= TOL


@pytest.mark.parametrize("family", list(LLMS))
def test_llm_packed_matches_hf_per_sample(hf, family):
    ref_model, folder = hf(family)
    lm = build_pretrained(folder).eval()
    lengths = [7, 13, 4]
    g = torch.Generator().manual_seed(2)
    samples = [torch.randint(0, 272, (n,), generator=g) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])  # restart at 0 in every sample
    ours = _logits(lm, torch.cat(samples), positions, TokenSpans.from_lengths(lengths))
    with torch.no_grad():
        ref = torch.cat([ref_model(s[None]).logits[0] for s in samples])
    assert _max_diff(ours, ref) <= TOL


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rope_scaling_past_original_context(hf, family):
    """llama3 (llama) and linear (qwen2) scaling over 48 positions, beyond llama's original 16."""
    ref_model, folder = hf(family)
    lm = build_pretrained(folder).eval()
    c = lm.cfg
    assert c.rope_scaling["rope_type"] == {"llama": "llama3", "qwen2": "linear"}[family]
    ids = torch.randint(0, 272, (1, 48), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(48)[None]
    with torch.no_grad():
        ref = ref_model(ids).logits
    assert _max_diff(_logits(lm, ids, positions, TokenSpans()), ref) <= TOL
    # the scaling matters: the same weights without it are far off
    plain = rope_inv_freq(c.dim_per_head, c.rope_theta, None)
    assert not torch.allclose(lm.rotary.inv_freq, plain)
    lm.rotary.inv_freq = plain
    assert _max_diff(_logits(lm, ids, positions, TokenSpans()), ref) > 1e-3


def test_siglip_matches_hf_and_skips_head(hf):
    ref_model, folder = hf("siglip")
    with torch.device("meta"):
        vision = VisionEncoder(config_from_folder(folder))
    report = load_module(folder, vision)
    vision.eval()
    assert vision.cfg.position_grid == 4 and vision.cfg.act == "tanh"
    assert report.skipped and all(n.startswith("head.") for n in report.skipped)
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = ref_model(images).last_hidden_state  # [2, 16 patches, 48]
        ours = vision(list(images))  # [32, 48], image after image
    assert _max_diff(ours, ref.flatten(0, 1)) <= TOL


def test_siglip_vision_tower_of_a_full_siglip_checkpoint(hf):
    ref_model, folder = hf("siglip_full")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "siglip"
    with torch.device("meta"):
        vision = VisionEncoder(config_from_folder(folder))
    report = load_module(folder, vision)
    skipped = set(report.skipped)
    assert {"logit_scale", "logit_bias", "vision_model.head.probe", "text_model.head.weight"} <= skipped
    assert all(n.startswith(("text_model.", "vision_model.head.", "logit_")) for n in skipped)
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = ref_model.vision_model(images).last_hidden_state
        ours = vision.eval()(list(images))
    assert _max_diff(ours, ref.flatten(0, 1)) <= TOL


def test_whisper_encoder_matches_hf_and_skips_decoder(hf):
    ref_model, folder = hf("whisper")
    audio = build_pretrained(folder).eval()
    assert audio.cfg.max_positions == 64 and audio.cfg.num_features == 16
    clips = torch.randn(2, 16, 2 * 64, generator=torch.Generator().manual_seed(5))  # the length HF requires
    with torch.no_grad():
        ref = ref_model.model.encoder(clips).last_hidden_state
        ours = audio(list(clips))
    assert _max_diff(ours, ref.flatten(0, 1)) <= TOL
    with torch.device("meta"):
        meta = type(audio)(audio.cfg)
    report = load_module(folder, meta)
    assert all(n.startswith("model.decoder.") or n == "proj_out.weight" for n in report.skipped)
    assert any(n.startswith("model.decoder.layers.0.") for n in report.skipped)


def test_sharded_checkpoint_loads(hf, tmp_path):
    ref_model, folder = hf("llama")
    ref_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    sharded, whole = build_pretrained(tmp_path), build_pretrained(folder)
    assert sharded.state_dict().keys() == whole.state_dict().keys()
    assert all(torch.equal(sharded.state_dict()[k], v) for k, v in whole.state_dict().items())


def test_meta_build_materialises_ties_buffers_and_reads_parts(hf):
    _, folder = hf("qwen2")
    lm = build_pretrained(folder)
    assert not any(t.is_meta for t in [*lm.parameters(), *lm.buffers()])
    assert lm.lm_head.weight is lm.embed_tokens.weight  # to_empty un-ties; loading re-ties
    c = lm.cfg
    assert torch.equal(lm.rotary.inv_freq, rope_inv_freq(c.dim_per_head, c.rope_theta, c.rope_scaling))
    # a rank reads only its part of a tensor: the box of the whole one
    with torch.device("meta"):
        meta = DecoderLM(c)
    weights = HFWeights(folder, meta)
    name, box = "layers.0.self_attn.q_proj.weight", (slice(4, 12), slice(3, 9))
    part = weights.read(name, box)
    assert part.shape == (8, 6)
    assert torch.equal(part.to(lm.get_parameter(name).dtype), lm.get_parameter(name).detach()[box])
    weights.close()


# ---------------------------------------------------------------- export


def _hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "head." not in k or "lm_head" in k}


@pytest.mark.parametrize("family", list(LLMS))
def test_llm_export_round_trip_is_exact(hf, tmp_path, family):
    ref_model, folder = hf(family)
    out = export_module(build_pretrained(folder), tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(out)
    assert type(back) is type(ref_model)
    assert back.state_dict().keys() == ref_model.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ref_model.state_dict().items())
    original, exported = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], v) for k, v in original.items())


def test_bf16_checkpoint_loads_and_exports_exactly(hf, tmp_path):
    ref_model, _ = hf("llama")
    bf16 = LlamaForCausalLM(LLMS["llama"][1]).to(torch.bfloat16)
    bf16.load_state_dict(ref_model.state_dict())
    bf16.save_pretrained(tmp_path / "bf16")
    lm = build_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert lm.embed_tokens.weight.dtype == torch.bfloat16 and lm.rotary.inv_freq.dtype == torch.float32
    out = export_module(lm, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    original, exported = load_file(tmp_path / "bf16" / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(v.dtype == torch.bfloat16 and torch.equal(exported[k], v) for k, v in original.items())


def test_encoder_export_round_trip_is_exact(hf, tmp_path):
    ref_model, folder = hf("siglip")
    back = SiglipVisionModel.from_pretrained(export_module(build_pretrained(folder), tmp_path / "vision"))
    assert back.config.vision_use_head is False
    ref = _hf_state(ref_model)  # everything but SigLIP's pooling head, which loom does not keep
    assert back.state_dict().keys() == ref.keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ref.items())

    ref_model, folder = hf("whisper")
    back = WhisperEncoder.from_pretrained(export_module(build_pretrained(folder), tmp_path / "audio"))
    ref = ref_model.model.encoder.state_dict()
    assert back.state_dict().keys() == ref.keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ref.items())


def test_job_loads_hf_modules_and_exports_its_checkpoint(hf, tmp_path, capsys):
    (llama, llama_dir), (siglip, siglip_dir), (whisper, whisper_dir) = hf("llama"), hf("siglip"), hf("whisper")
    cfg = load_config(None, [
        f"--model.language.hf={llama_dir}", f"--model.vision.hf={siglip_dir}", f"--model.audio.hf={whisper_dir}",
        "--data.train_size=16", "--data.heldout_size=2", "--train.global_batch_size=4", "--train.steps=1",
        "--train.device=cpu", "--run.tensorboard=false", "--run.progress=false", f"--run.out_dir={tmp_path}/run",
    ])
    # sizes come from the folders' config.json
    assert (cfg.model.language.hidden_size, cfg.model.vision.hidden_size, cfg.model.audio.hidden_size) == (64, 48, 48)
    trainer = Trainer(cfg)
    model = trainer.model
    assert torch.equal(model.language.layers["1"].mlp.down_proj.weight, llama.model.layers[1].mlp.down_proj.weight)
    assert torch.equal(model.vision.encoder.layers[1].mlp.fc2.bias, siglip.encoder.layers[1].mlp.fc2.bias)
    assert torch.equal(model.audio.encoder.embed_positions, whisper.model.encoder.embed_positions.weight)

    trainer.train_step(trainer.batches.shard(0))
    assert not torch.equal(model.language.layers["1"].mlp.down_proj.weight, llama.model.layers[1].mlp.down_proj.weight)
    trainer.checkpoint()
    assert loom.cli.main(["export", str(tmp_path / "run" / "step-1"), "--hf", str(tmp_path / "hf")]) == 0
    assert "vision.projector.linear_1.weight" in capsys.readouterr().out  # reported as not exported

    exported = {}
    for name, cls in [("language", AutoModelForCausalLM), ("vision", SiglipVisionModel), ("audio", WhisperEncoder)]:
        exported[name], info = cls.from_pretrained(tmp_path / "hf" / name, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (name, info)
        ours = (model.language if name == "language" else model.encoder(name).encoder).eval()
        back = build_pretrained(tmp_path / "hf" / name)  # loom → HF → loom is exact
        assert back.state_dict().keys() == ours.state_dict().keys()
        assert all(torch.equal(back.state_dict()[k], v) for k, v in ours.state_dict().items())
    # and transformers computes what the trained loom modules compute
    g = torch.Generator().manual_seed(6)
    ids, images, clips = torch.randint(0, 261, (1, 12), generator=g), torch.randn(1, 3, 16, 16), torch.randn(1, 16, 128)
    with torch.no_grad():
        assert _max_diff(_logits(model.language, ids, torch.arange(12)[None], TokenSpans()),
                         exported["language"](ids).logits) <= TOL
        assert _max_diff(model.vision.encoder(list(images)), exported["vision"](images).last_hidden_state[0]) <= TOL
        assert _max_diff(model.audio.encoder(list(clips)), exported["audio"](clips).last_hidden_state[0]) <= TOL


def _load_under_layout(folders: dict[str, str]) -> dict:
    """On every rank: the job's model under LLM tp2·dp2 and vision tp2 from HF folders; what each rank read of
    each folder (elements), what it holds, and whether the shards put together are the folders' tensors."""
    import torch.distributed as dist

    from loom.data.tokenizer import ByteTokenizer
    from loom.train.build import build_job_model, initial_weights, setup_parallel

    cfg = load_config(None, [f"--model.{m}.hf={f}" for m, f in folders.items()] + [
        "--layout.language.tp=2", "--layout.vision.tp=2", "--train.device=cpu"], world_size=dist.get_world_size())
    model = build_job_model(cfg, ByteTokenizer())
    weights = initial_weights(model, cfg)
    read = dict.fromkeys(weights.folders, 0)  # elements taken out of each folder's files

    class CountedSlice:
        def __init__(self, part, prefix):
            self.part, self.prefix = part, prefix

        def __getitem__(self, box):
            out = self.part[box]
            read[self.prefix] += out.numel()
            return out

    class CountedFile:
        def __init__(self, handle, prefix):
            self.handle, self.prefix = handle, prefix

        def get_slice(self, name):
            return CountedSlice(self.handle.get_slice(name), self.prefix)

    for prefix, w in weights.folders.items():
        w._open = lambda path, _open=w._open, _prefix=prefix: CountedFile(_open(path), _prefix)
    setup_parallel(model, cfg, torch.device("cpu"), weights)
    weights.close()
    held = dict.fromkeys(read, 0)
    for name, t in model.state_dict().items():
        prefix = next((p for p in held if name.startswith(p)), None)
        if prefix is not None:
            held[prefix] += (t.to_local() if hasattr(t, "to_local") else t).numel()
    full = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in model.state_dict().items()}
    same = {}
    for module, folder in folders.items():
        prefix = "language." if module == "language" else f"{module}.encoder."
        want = build_pretrained(folder).state_dict()
        same[module] = all(torch.equal(full[prefix + k], v) for k, v in want.items())
    whole = {p: sum(t.numel() for n, t in full.items() if n.startswith(p)) for p in read}
    return {"read": read, "held": held, "whole": whole, "same": same}


def test_a_layout_reads_only_its_part_of_each_hf_tensor(hf, worlds):
    folders = {"language": str(hf("llama")[1]), "vision": str(hf("siglip")[1]), "audio": str(hf("whisper")[1])}
    for rank in worlds.run(4, _load_under_layout, folders, timeout=300):
        assert all(rank["same"].values()), rank["same"]  # the shards put together are the folder's tensors
        # each rank reads exactly what it holds: its tp × dp part (FSDP's dp4 for audio), never whole tensors
        assert rank["read"] == rank["held"], rank
        for prefix in ("language.", "vision.encoder."):
            assert rank["read"][prefix] < 0.3 * rank["whole"][prefix], (prefix, rank)


def _packed_logits_under_tp(folder: str, lengths: list[int]) -> torch.Tensor:
    """On every rank: the folder's LLM loaded with tp over all ranks (heads split; QK-norm weights, and KV heads
    when tp exceeds them, replicated), the packed samples' logits gathered whole."""
    import torch.distributed as dist

    from loom.data.tokenizer import ByteTokenizer
    from loom.train.build import build_job_model, initial_weights, setup_parallel

    cfg = load_config(None, [f"--model.language.hf={folder}", f"--layout.language.tp={dist.get_world_size()}",
                             "--train.device=cpu"], world_size=dist.get_world_size())
    model = build_job_model(cfg, ByteTokenizer())
    weights = initial_weights(model, cfg)
    setup_parallel(model, cfg, torch.device("cpu"), weights)
    weights.close()
    g = torch.Generator().manual_seed(2)
    ids = torch.cat([torch.randint(0, 272, (n,), generator=g) for n in lengths])
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        return model.language(ids, positions, TokenSpans.from_lengths(lengths)).full_tensor()


@pytest.mark.parametrize("family,tp", [("qwen3", 2), ("qwen2", 4), ("qwen3", 4)])
def test_an_llm_under_tp_gives_the_hf_logits(hf, worlds, family, tp):
    """Qwen3's QK-norm at tp2; tp4 over 2 KV heads (each replicated on 2 ranks), with and without QK-norm."""
    ref_model, folder = hf(family)
    lengths = [7, 13, 4]
    g = torch.Generator().manual_seed(2)
    samples = [torch.randint(0, 272, (n,), generator=g) for n in lengths]
    with torch.no_grad():
        ref = torch.cat([ref_model(s[None]).logits[0] for s in samples])
    for ours in worlds.run(tp, _packed_logits_under_tp, str(folder), lengths, timeout=240):
        assert _max_diff(ours, ref) <= TOL


def _train_and_save_under_tp4(folder: str, out: str) -> dict[str, torch.Tensor]:
    """On every rank: one step of a Qwen3 folder's LLM under tp4 (2 KV heads: each replicated on 2 ranks;
    QK-norm), saved; the trained language weights gathered whole."""
    import torch.distributed as dist

    cfg = load_config(None, [
        f"--model.language.hf={folder}", "--layout.language.tp=4", "--data.train_size=16", "--data.heldout_size=2",
        "--train.global_batch_size=4", "--train.steps=1", "--train.device=cpu", "--run.tensorboard=false",
        "--run.progress=false", f"--run.out_dir={out}", "--data.workers=0"], world_size=dist.get_world_size())
    trainer = Trainer(cfg)
    trainer.train_step()
    trainer.checkpoint()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
            for k, v in trainer.model.language.state_dict().items()}


def test_a_qwen3_trained_under_tp4_over_2_kv_heads_exports_its_weights(hf, worlds, tmp_path):
    qwen3, folder = hf("qwen3")
    trained = worlds.run(4, _train_and_save_under_tp4, str(folder), str(tmp_path / "run"), timeout=300)
    assert all(all(torch.equal(r[k], v) for k, v in trained[0].items()) for r in trained[1:])  # one model
    assert not torch.equal(trained[0]["layers.0.self_attn.k_norm.weight"],
                           qwen3.model.layers[0].self_attn.k_norm.weight)
    assert loom.cli.main(["export", str(tmp_path / "run" / "step-1"), "--hf", str(tmp_path / "hf")]) == 0
    back = build_pretrained(tmp_path / "hf" / "language").state_dict()  # loom → HF → loom is exact
    assert back.keys() == trained[0].keys() and all(torch.equal(back[k], v) for k, v in trained[0].items())


def test_a_resumed_run_keeps_the_folders_as_its_initial_reference(hf, tmp_path):
    """train.reference = "initial" is the Hugging Face folder's weights, also after a resume (which takes the
    policy from its checkpoint, but must not take the reference from seeded draws)."""
    import loom.data.source
    from test_grpo import _with_rl_fields

    llama, folder = hf("llama")
    overrides = [f"--model.language.hf={folder}", "--data.train_size=16", "--data.heldout_size=2",
                 "--train.global_batch_size=4", "--train.steps=2", "--train.device=cpu", "--run.tensorboard=false",
                 "--run.progress=false", f"--run.out_dir={tmp_path}/run", "--train.objective=grpo",
                 "--train.reference=initial", "--data.workers=0"]
    plain = loom.data.source.to_sample
    loom.data.source.to_sample = _with_rl_fields(plain)
    try:
        first = Trainer(load_config(None, overrides))
        first.train_step()
        first.checkpoint()
        resumed = Trainer(load_config(None, [*overrides, "--run.resume=auto"]))
    finally:
        loom.data.source.to_sample = plain
    assert resumed.step == 1
    name = "language.layers.1.mlp.down_proj.weight"
    assert torch.equal(resumed.plan.reference.parts[name], llama.model.layers[1].mlp.down_proj.weight)
    assert torch.equal(resumed.model.get_parameter(name), first.model.get_parameter(name))  # the checkpoint's
