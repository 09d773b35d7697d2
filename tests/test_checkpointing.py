"""Activation checkpointing (`train.activation_checkpointing`): every layout with "full" or "selective" still
equals the one-process reference (which never checkpoints), "full" really runs each block's forward again in
backward, "selective" runs its cheap ops again but not its matmuls or attention, and parameter names stay.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from conftest import MIXED_SPECS, TINY_MODEL_OVERRIDES, make_sample
from oracle import run_verify
from torch.utils._python_dispatch import TorchDispatchMode

from loom.config import ConfigError
from loom.job import load_config
from loom.data.batch import IGNORE_INDEX
from loom.data.packing import pack_samples
from loom.data.tokenizer import ByteTokenizer
from loom.parallel.blocks import transformer_blocks
from loom.train.build import build_job_model, setup_parallel

FULL = ["--train.activation_checkpointing=full"]
SELECTIVE = ["--train.activation_checkpointing=selective"]
SP = ["--layout.vision.tp=2", "--layout.audio.tp=2", "--layout.language.tp=2",
      "--layout.language.sequence_parallel=true", "--data.pad_to_multiple=2"]
LAYOUTS = {
    "dp2": (2, []),
    "fan-in": (4, ["--layout.vision.tp=1", "--layout.language.tp=2"]),  # vision dp4 → LLM tp2 × dp2
    "cp2": (2, ["--layout.language.cp=2", "--data.pad_to_multiple=4"]),  # recomputation re-gathers K/V
    "tp2-sp": (2, SP),
}
MODULES = ("vision", "audio", "language")


def _check(name: str, per_rank: list[list[dict]]) -> None:
    for rank, steps in enumerate(per_rank):
        for i, s in enumerate(steps):
            assert s["passed"], f"{name} rank {rank} step {i + 1}: {s['failures']}"
            assert s["modules"] == sorted(MODULES)


@pytest.mark.parametrize("mode", [FULL, SELECTIVE], ids=["full", "selective"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_with_checkpointing_matches_reference(worlds, name, mode):
    world, overrides = LAYOUTS[name]
    _check(name, worlds.run(world, run_verify, TINY_MODEL_OVERRIDES + overrides + mode, steps=2, timeout=300))


def test_full_checkpointing_composes_with_compile(worlds):
    # the compiled block forward runs inside the checkpoint; the recomputation replays the same graphs (traced
    # by dynamo + AOTAutograd whatever the backend: aot_eager spares CI inductor's C++ compile)
    overrides = TINY_MODEL_OVERRIDES + ["--train.compile=true", "--train.compile_backend=aot_eager"] + FULL
    _check("compiled-dp2-full", worlds.run(2, run_verify, overrides, steps=2, timeout=600))


# ---------------------------------------------------------------- it is applied, and it recomputes


class _OpCounter(TorchDispatchMode):
    """Counts aten ops that really run (ops that selective checkpointing serves from storage never reach it)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._schema.name.split("::")[-1]] += 1
        return func(*args, **(kwargs or {}))


def _tiny(mode: str, *extra: str):
    """The tiny model through setup_parallel on one process (no torchrun), and a mixed packed batch."""
    cfg = load_config(None, [*TINY_MODEL_OVERRIDES, "--train.device=cpu",
                             f"--train.activation_checkpointing={mode}", *extra])
    tok = ByteTokenizer()
    torch.manual_seed(0)
    model = build_job_model(cfg, tok)
    names = sorted(model.state_dict())
    setup_parallel(model, cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    batch = pack_samples([make_sample(s, model, tok, g) for s in MIXED_SPECS], tok.pad_id, backend="sdpa")
    return model, names, batch


def _step(model, batch) -> tuple[dict[str, int], Counter, Counter, list[torch.Tensor]]:
    """One forward + backward: calls of each block's MLP (it runs inside the checkpointed body; a pre-hook,
    since the recomputation stops once it has what backward needs), the ops run in forward and in backward,
    and the gradients."""
    calls: Counter[str] = Counter()
    hooks = [block.mlp.register_forward_pre_hook(lambda *_, key=f"{name}.{i}": calls.update([key]))
             for name in MODULES for i, block in enumerate(transformer_blocks(name, model.get_submodule(name)))]
    with _OpCounter() as fwd:
        logits = model(batch.input_ids, batch.positions, batch.spans, batch.modality_inputs)
        loss = F.cross_entropy(logits.float(), batch.labels, ignore_index=IGNORE_INDEX, reduction="sum")
    with _OpCounter() as bwd:
        loss.backward()
    for h in hooks:
        h.remove()
    return dict(calls), fwd.counts, bwd.counts, [p.grad for p in model.parameters()]


MATMULS = ("mm", "addmm", "bmm")
LLM_BLOCKS, ENCODER_BLOCKS = 2, 1 + 1  # the tiny model: LLM 2 layers, vision 1, audio 1
SDPA = "_scaled_dot_product_flash_attention_for_cpu"


@pytest.fixture(scope="module")
def steps():
    return {mode: (_step(*_tiny(mode)[::2])) for mode in ("none", "full", "selective")}


def test_modes_give_the_same_gradients(steps):
    _, _, _, ref = steps["none"]
    for mode in ("full", "selective"):
        for a, b in zip(steps[mode][3], ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_none_runs_each_block_once(steps):
    calls, _, bwd, _ = steps["none"]
    assert len(calls) == LLM_BLOCKS + ENCODER_BLOCKS and set(calls.values()) == {1}, calls
    assert bwd[SDPA] == 0 and bwd["silu"] == 0


def test_full_runs_each_block_forward_again_in_backward(steps):
    calls, fwd, bwd, _ = steps["full"]
    none_calls, none_fwd, none_bwd, _ = steps["none"]
    assert calls.keys() == none_calls.keys() and set(calls.values()) == {2}, calls
    # the blocks run again: their matmuls (one per projection on the packed [tokens, dim] streams, q/k/v as
    # one (layers.project): 5 per LLM block, 4 per encoder block) but the last, whose output backward does not
    # need (the recomputation stops early), attention, activations
    recomputed = LLM_BLOCKS * (5 - 1) + ENCODER_BLOCKS * (4 - 1)
    assert sum(bwd[m] for m in MATMULS) == sum(none_bwd[m] for m in MATMULS) + recomputed
    assert bwd[SDPA] == none_fwd[SDPA] > 0
    assert bwd["silu"] == LLM_BLOCKS  # SwiGLU's activation
    assert all(fwd[m] == none_fwd[m] for m in (*MATMULS, SDPA, "silu"))  # the forward computes as before


def test_selective_recomputes_cheap_ops_but_not_matmuls_or_attention(steps):
    calls, fwd, bwd, _ = steps["selective"]
    _, none_fwd, none_bwd, _ = steps["none"]
    assert set(calls.values()) == {2}, calls  # the block's code runs again ...
    assert sum(bwd[m] for m in MATMULS) == sum(none_bwd[m] for m in MATMULS)  # ... but no matmul
    assert bwd[SDPA] == 0  # nor attention
    assert bwd["silu"] == LLM_BLOCKS and bwd["rsqrt"] > none_bwd["rsqrt"]  # activations and RMSNorms run again
    assert bwd["native_layer_norm"] == 2 * ENCODER_BLOCKS  # and the encoders' LayerNorms


def test_state_dict_keys_do_not_change():
    for mode in ("full", "selective"):
        model, names, _ = _tiny(mode)
        assert sorted(model.state_dict()) == names
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in build_job_model(
            load_config(None, [*TINY_MODEL_OVERRIDES]), ByteTokenizer()).named_parameters()]
        assert not any("checkpoint" in n for n in names)


def _applied_under_layout(mode: str) -> tuple[bool, bool]:
    """On a dp2 world: the blocks are checkpointed under FSDP and the state_dict keys are the model's own."""
    cfg = load_config(None, [*TINY_MODEL_OVERRIDES, "--train.device=cpu", f"--train.activation_checkpointing={mode}"],
                      world_size=2)
    model = build_job_model(cfg, ByteTokenizer())
    names = sorted(model.state_dict())
    setup_parallel(model, cfg, torch.device("cpu"))
    applied = all(getattr(b.forward, "activation_checkpointing", None) == mode
                  for m in MODULES for b in transformer_blocks(m, model.get_submodule(m)))
    return applied, sorted(model.state_dict()) == names


def test_applied_under_a_layout_with_the_same_names(worlds):
    assert worlds.run(2, _applied_under_layout, "selective") == [(True, True)] * 2


# ---------------------------------------------------------------- configuration


def test_config_rejects_unknown_modes_and_selective_with_compile():
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing = 'partial' is not allowed"):
        load_config(None, ["--train.activation_checkpointing=partial"])
    with pytest.raises(ConfigError, match=r"'selective' does not compose with train\.compile"):
        load_config(None, SELECTIVE + ["--train.compile=true"])
    assert load_config(None, []).train.activation_checkpointing == "none"
    assert load_config(None, FULL + ["--train.compile=true"]).train.activation_checkpointing == "full"
