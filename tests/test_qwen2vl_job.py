"""A Qwen2-VL folder as a job's model (`[model] hf`): a user's conversations with images of assorted sizes, sized by
the folder's processor, M-RoPE positions built with the packing, under layouts against the one-process reference
(`loom verify` on gloo ranks): the tower fanning in to the LLM, the LLM at cp2 (M-RoPE sharded) and at pp2."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from conftest import tiny_chat_tokenizer  # noqa: E402
from qwen2vl_folders import write_qwen2vl  # noqa: E402
from test_hf_llava import _image_conversations  # noqa: E402

# (world size, overrides); 2-rank worlds first (the pool keeps two worlds alive)
LAYOUTS = {
    "llm-cp2": (2, ["--layout.language.cp=2", "--data.pad_to_multiple=4"]),  # vision dp2 → LLM cp2
    "llm-pp2": (2, ["--layout.language.pp=2", "--train.microbatches=2", "--data.tokens_per_microbatch=512"]),
    "vision-dp4-fan-in-llm-tp2": (4, ["--layout.vision.tp=1", "--layout.language.tp=2"]),  # dp4 → tp2 × dp2
}


@pytest.fixture(scope="module")
def qwen2vl_job(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2vl_job")
    _, folder = write_qwen2vl(root / "folder")
    (root / "tok").mkdir()
    return [f"--model.hf={folder}", f"--model.tokenizer={tiny_chat_tokenizer(root / 'tok')}",
            f'--data.sources=[{{path = "{_image_conversations(root / "data")}", weight = 1.0}}]',
            "--data.heldout_size=2", "--train.global_batch_size=8"]


def _verify(overrides: list[str]) -> list[dict]:
    from oracle import run_verify

    return run_verify(overrides, steps=2)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loom_verify_passes_for_a_qwen2vl_folder_under_layouts(qwen2vl_job, worlds, name):
    world, layout = LAYOUTS[name]
    per_rank = worlds.run(world, _verify, [*qwen2vl_job, *layout], timeout=300)
    for rank, checks in enumerate(per_rank):
        assert len(checks) == 2
        for step, check in enumerate(checks):
            assert check["modules"] == ["language", "vision"]
            assert check["ref_norm"] > check["clip"], f"rank {rank} step {step + 1}: clipping not active"
            assert check["passed"], f"rank {rank} step {step + 1}: {check['failures']}"
        assert checks == per_rank[0]


def test_a_qwen2vl_job_packs_three_position_streams_from_its_images_grids(qwen2vl_job):
    """The job's model is the folder's (Qwen2-VL's tower, M-RoPE LLM), and a packed batch of its conversations
    carries each token's (time, height, width) positions, equal to data/mrope.py's from each image's grid."""
    from loom.data.mrope import mrope_positions
    from loom.job import load_config
    from loom.models.qwen2_vision import Qwen2VisionEncoder
    from loom.train.inputs import collate
    from loom.train.job_data import build_job_data, job_tokenizer, with_vocabulary
    from loom.train.job_model import build_job_model, token_counters

    cfg = load_config(None, qwen2vl_job)
    tok = job_tokenizer(cfg)
    cfg = with_vocabulary(cfg, tok)
    model = build_job_model(cfg, tok)
    assert isinstance(model.encoder("vision").encoder, Qwen2VisionEncoder)
    counters = token_counters(model)
    samples = [build_job_data(cfg, tok, counters).train[i] for i in range(6)]
    grids = [[(1, im.shape[-2] // 14, im.shape[-1] // 14) for im in s.images] for s in samples]
    assert sum(map(len, grids)) >= 4
    batch = collate(samples, cfg, tok, multiple=1, length=sum(map(len, samples)))
    image_id = tok.placeholder_ids["vision"]
    want = torch.cat([torch.tensor(mrope_positions(s.tokens, image_id, g)) for s, g in zip(samples, grids)])
    assert torch.equal(batch.positions, want)
    assert (batch.positions[:, 1] != batch.positions[:, 2]).any()
