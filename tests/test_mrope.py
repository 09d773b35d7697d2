"""Qwen2-VL's M-RoPE in loom's LLM: the three position streams (time, height, width) built on the host equal
transformers' `get_rope_index`, ride the packed batch as [T, 3], and give Qwen2-VL's text-model logits."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from qwen2vl_folders import END_ID, IMAGE_ID, MERGE, START_ID, TEXT, qwen2vl_model  # noqa: E402

from loom.data.mrope import mrope_positions  # noqa: E402
from loom.data.packing import pack_samples  # noqa: E402
from loom.data.sample import Sample  # noqa: E402
from loom.models.llm import DecoderLM, LLMConfig  # noqa: E402

TOL = 1e-5
# each sample's images as patch grids (t, h, w) before the 2×2 merger: none, one, two of other shapes and a wide one
GRIDS = [[], [(1, 4, 6)], [(1, 2, 2), (1, 6, 4)], [(1, 2, 8)]]


def sample_ids(grids: list[tuple[int, int, int]], k: int) -> list[int]:
    """Text, then each image as Qwen2-VL's chat template writes it (start, its merged tokens, end), then text."""
    g = torch.Generator().manual_seed(k)
    ids = torch.randint(10, 290, (3 + k,), generator=g).tolist()
    for t, h, w in grids:
        ids += [START_ID] + [IMAGE_ID] * (t * h * w // MERGE**2) + [END_ID]
        ids += torch.randint(10, 290, (2 + k,), generator=g).tolist()
    return ids


def hf_positions(ref, ids: list[int], grids) -> torch.Tensor:
    x = torch.tensor(ids)[None]
    kinds = (x == IMAGE_ID).int()
    thw = torch.tensor(grids) if grids else None
    return ref.model.get_rope_index(x, kinds, image_grid_thw=thw)[0][:, 0]  # [3, tokens]


@pytest.mark.parametrize("k", range(len(GRIDS)))
def test_mrope_positions_equal_transformers_rope_index(k):
    ref = qwen2vl_model()
    ids = sample_ids(GRIDS[k], k)
    got = torch.tensor(mrope_positions(ids, IMAGE_ID, GRIDS[k], MERGE)).T
    assert torch.equal(got, hf_positions(ref, ids, GRIDS[k]))
    if GRIDS[k]:
        assert not torch.equal(got[1], got[2])  # the streams part on an image


def test_mrope_positions_refuse_a_grid_the_placeholders_do_not_match():
    with pytest.raises(ValueError, match="placeholders"):
        mrope_positions([IMAGE_ID] * 3 + [5], IMAGE_ID, [(1, 4, 4)], MERGE)
    with pytest.raises(ValueError, match="left over"):
        mrope_positions([5, 6], IMAGE_ID, [(1, 2, 2)], MERGE)


def loom_llm(ref) -> DecoderLM:
    cfg = LLMConfig(vocab_size=TEXT["vocab_size"], hidden_size=TEXT["hidden_size"],
                    num_layers=TEXT["num_hidden_layers"], num_heads=TEXT["num_attention_heads"],
                    num_kv_heads=TEXT["num_key_value_heads"], intermediate_size=TEXT["intermediate_size"],
                    rms_norm_eps=TEXT["rms_norm_eps"], rope_theta=10000.0, attention_bias=True, tie_embeddings=False,
                    rope_scaling={"rope_type": "mrope", "mrope_section": [2, 3, 3]})
    lm = DecoderLM(cfg)
    prefix = "model.language_model."
    weights = {k[len(prefix):]: v for k, v in ref.state_dict().items() if k.startswith(prefix)}
    weights["lm_head.weight"] = ref.lm_head.weight
    lm.load_state_dict(weights)
    return lm.eval()


def test_loom_llm_with_mrope_gives_qwen2vl_text_logits_for_packed_samples():
    """The placeholders embed as their token ids here (no tower): the LLM's positions alone are under test."""
    ref = qwen2vl_model()
    lm = loom_llm(ref)
    ids = [sample_ids(grids, k) for k, grids in enumerate(GRIDS)]
    samples = [Sample(x, [True] * len(x), [], [], rope_positions=mrope_positions(x, IMAGE_ID, grids, MERGE))
               for x, grids in zip(ids, GRIDS)]
    batch = pack_samples(samples, pad_id=0, multiple_of=4)
    assert batch.positions.shape == (batch.input_ids.numel(), 3)
    with torch.no_grad():
        got = lm(batch.input_ids, batch.positions, batch.spans)
        want = []
        for x, grids in zip(ids, GRIDS):
            hidden = ref.model.language_model(input_ids=torch.tensor(x)[None],
                                              position_ids=hf_positions(ref, x, grids)[:, None]).last_hidden_state
            want.append(ref.lm_head(hidden)[0])
    starts = batch.spans.cu_seqlens.tolist()
    assert want[1].abs().max() > 1.0
    for start, w in zip(starts, want):
        assert (got[start:start + len(w)] - w).abs().max() <= TOL
    # one stream for all three (text positions) is not the same model: the check can tell
    with torch.no_grad():
        flat = lm(batch.input_ids, batch.positions[:, 0], batch.spans)
    assert (flat[starts[1]:starts[1] + len(want[1])] - want[1]).abs().max() > 1e-3


def _cp_logits_minus_whole() -> float:
    """An M-RoPE LLM at cp = world size: each rank's logits (its zigzag share, positions sharded with the tokens)
    minus the one-process logits at those tokens."""
    import torch.distributed as dist

    from loom.parallel.context import shard_for_context, zigzag_indices

    torch.manual_seed(0)
    lm = DecoderLM(LLMConfig(vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                             intermediate_size=96, rope_scaling={"rope_type": "mrope", "mrope_section": [2, 3, 3]},
                             init_std=0.2)).eval()
    samples = [Sample(x, [True] * len(x), [], [], rope_positions=mrope_positions(x, IMAGE_ID, grids, MERGE))
               for x, grids in ((sample_ids(grids, k), grids) for k, grids in enumerate(GRIDS))]
    batch = pack_samples(samples, pad_id=0, multiple_of=2 * dist.get_world_size())
    local, _ = shard_for_context(batch, dist.group.WORLD, [])
    assert local.positions.shape == (local.input_ids.numel(), 3)
    lengths = torch.diff(batch.spans.cu_seqlens).tolist()
    keep = zigzag_indices(lengths, dist.get_rank(), dist.get_world_size())
    with torch.no_grad():
        whole = lm(batch.input_ids, batch.positions, batch.spans)
        return (lm(local.input_ids, local.positions, local.spans) - whole[keep]).abs().max().item()


def test_an_mrope_llm_at_cp2_gives_the_one_process_logits(worlds):
    assert max(worlds.run(2, _cp_logits_minus_whole)) <= TOL


def test_padded_samples_carry_the_streams_too_and_give_the_packed_logits():
    """BSHD: positions [rows, seq, 3] (a filler row 0, 1, 2, … on every stream); each sample's logits equal its
    packed ones."""
    from loom.data.batch import pad_samples

    torch.manual_seed(0)
    lm = DecoderLM(LLMConfig(vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                             intermediate_size=96, rope_scaling={"rope_type": "mrope", "mrope_section": [2, 3, 3]},
                             init_std=0.2)).eval()
    samples = [Sample(x, [True] * len(x), [], [], rope_positions=mrope_positions(x, IMAGE_ID, grids, MERGE))
               for x, grids in ((sample_ids(grids, k), grids) for k, grids in enumerate(GRIDS))]
    padded, packed = pad_samples(samples, 0, rows=len(samples) + 1), pack_samples(samples, 0)
    assert padded.positions.shape == (len(samples) + 1, padded.input_ids.shape[1], 3)
    assert torch.equal(padded.positions[-1, :, 2], torch.arange(padded.input_ids.shape[1]))
    with torch.no_grad():
        rows, flat = lm(padded.input_ids, padded.positions, padded.spans), lm(packed.input_ids, packed.positions,
                                                                             packed.spans)
    for r, (start, s) in enumerate(zip(packed.spans.cu_seqlens.tolist(), samples)):
        assert (rows[r, :len(s)] - flat[start:start + len(s)]).abs().max() <= TOL
