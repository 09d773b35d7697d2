"""A pipelined encoder's parts on one process, no ranks: the stages chained equal the whole encoder (forward,
backward, names), the split is FLOP-balanced, the stage order, and the layouts refused before anything is built."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from conftest import N_MELS, TINY_MODEL_OVERRIDES, tiny_audio_config, tiny_vision_config

from loom.config import ConfigError
from loom.job import load_config
from loom.models.audio import AudioEncoder
from loom.models.multimodal import ModalityEncoder
from loom.models.vision import VisionEncoder
from loom.parallel.encoder_pipeline import encoder_stage, split_encoder_layers
from loom.train.encoder_ranks import stage0_order, stage_order
from loom.train.flops import matmul_params

LLM_WIDTH = 24


def _encoder(kind: str, layers: int) -> ModalityEncoder:
    torch.manual_seed(0)
    if kind == "vision":
        cfg = tiny_vision_config()
        cfg.num_layers = layers
        return ModalityEncoder(VisionEncoder(cfg), LLM_WIDTH)
    cfg = tiny_audio_config()
    cfg.num_layers = layers
    return ModalityEncoder(AudioEncoder(cfg), LLM_WIDTH)


def _items(kind: str, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if kind == "vision":  # images of different sizes
        return [torch.randn(3, 4 * (2 + i), 4 * (3 - i % 2), generator=gen) for i in range(n)]
    return [torch.randn(N_MELS, 6 + 4 * i, generator=gen) for i in range(n)]


@pytest.mark.parametrize("kind,stages,items", [("vision", 2, 3), ("vision", 3, 0), ("audio", 2, 2), ("audio", 3, 0)])
def test_stages_chained_equal_the_whole_encoder(kind, stages, items):
    """Stage after stage (hidden states handed on, row counts from the items) gives the whole encoder's rows and,
    backward, its gradients; the stages' parameter names partition the whole's. No item: zero rows, as unsplit."""
    whole = _encoder(kind, layers=3)
    parts = [encoder_stage(copy.deepcopy(whole), s, stages) for s in range(stages)]
    names = [set(dict(p.named_parameters())) for p in parts]
    assert set().union(*names) == set(dict(whole.named_parameters()))
    assert sum(map(len, names)) == len(dict(whole.named_parameters()))  # each weight on exactly one stage
    x = _items(kind, items)
    rows = [whole.num_tokens(item) for item in x]
    ref = whole(x)
    h = x
    for part in parts:
        h = part(h, rows)
    torch.testing.assert_close(h, ref, rtol=0, atol=0)
    assert h.shape[0] == sum(rows)
    weight = torch.randn(ref.shape)
    (ref * weight).sum().backward()
    (h * weight).sum().backward()  # one graph through every stage: gradients reach stage 0's stem
    grads = {n: p.grad for part in parts for n, p in part.named_parameters()}
    for name, p in whole.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7)


def test_split_is_flop_balanced():
    """The costliest stage (stem on the first, projector on the last) is as cheap as any contiguous split's."""
    enc = _encoder("vision", layers=5)
    layer = matmul_params(enc.encoder.layers[0])
    stem = matmul_params(enc.encoder.patch_embedding)
    head = matmul_params(enc.projector)
    for stages in (2, 3, 5):
        split = split_encoder_layers(enc, stages)
        assert [i for s in split for i in s] == list(range(5)) and all(split)

        def cost(sizes):
            c = [n * layer for n in sizes]
            c[0] += stem
            c[-1] += head
            return max(c)

        best = min(cost([b - a for a, b in zip((0, *cuts), (*cuts, 5))])
                   for cuts in itertools.combinations(range(1, 5), stages - 1))
        assert cost([len(s) for s in split]) == best


def test_stage_order():
    """The last stage keeps the LLM stage 0's order; an earlier stage runs every forward, then the backwards in
    the order the LLM's run; forward only, every stage runs the forwards in turn."""
    llm = stage0_order("1f1b", 2, 4)
    assert stage_order(llm, last=True, train=True, microbatches=4) == llm
    assert stage_order(llm, last=False, train=True, microbatches=4) == (
        [("F", i) for i in range(4)] + [("B", i) for i in range(4)])
    assert stage_order(llm, last=True, train=False, microbatches=4) == [("F", i) for i in range(4)]


def _noncolocated(*extra: str) -> list[str]:
    return [*TINY_MODEL_OVERRIDES, "--layout.world_size=4", "--layout.vision.ranks=0-1", "--layout.audio.ranks=0-1",
            "--layout.language.ranks=2-3", "--model.vision.num_layers=2", "--model.audio.num_layers=2", *extra]


def test_encoder_pp_on_ranks_of_their_own_loads():
    load_config(None, _noncolocated("--layout.vision.pp=2", "--layout.audio.pp=2"), world_size=4)
    load_config(None, _noncolocated("--layout.vision.pp=2", "--layout.audio.pp=2", "--layout.language.pp=2",
                                    "--train.microbatches=2", "--data.tokens_per_microbatch=512"), world_size=4)


REJECTED = {
    "colocated": ([*TINY_MODEL_OVERRIDES, "--layout.world_size=2", "--layout.vision.pp=2"], 2,
                  ["vision: pp = 2", "colocated", "layout.vision.ranks"]),
    "more-stages-than-layers": (_noncolocated("--layout.vision.pp=2", "--layout.audio.pp=2",
                                              "--model.audio.num_layers=1"), 4,
                                ["audio: pp = 2", "model.audio.num_layers = 1"]),
    "shared-ranks-other-pp": (_noncolocated("--layout.vision.pp=2"), 4,
                              ["vision: pp = 2", "audio", "pp = 1", "layout.audio.pp = 2"]),
}


@pytest.mark.parametrize("name", list(REJECTED))
def test_encoder_pp_rejected_with_a_clear_message(name):
    overrides, world, fragments = REJECTED[name]
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, world_size=world)
    missing = [f for f in fragments if f not in str(err.value)]
    assert not missing, f"{missing} not in message: {err.value}"
