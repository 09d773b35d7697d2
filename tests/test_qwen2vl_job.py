"""A Qwen2-VL folder as a job's model (`[model] hf`): a user's conversations with images of assorted sizes, sized by
the folder's processor, M-RoPE positions built with the packing, under layouts against the one-process reference
(`loom verify` on gloo ranks): the tower at tp2 with sequence parallel fanning out to the LLM, the tower fanning in
to the LLM, the LLM at cp2 (M-RoPE sharded) and at pp2."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from conftest import tiny_chat_tokenizer  # noqa: E402
from qwen2vl_folders import write_qwen2_5_vl, write_qwen2vl  # noqa: E402
from test_hf_llava import _image_conversations  # noqa: E402
from oracle import assert_all_passed  # noqa: E402

# (world size, overrides); 2-rank worlds first (the pool keeps two worlds alive)
LAYOUTS = {
    "vision-tp2-sp-fan-out": (2, ["--layout.vision.tp=2", "--layout.vision.sequence_parallel=true"]),  # dp1 → dp2
    "llm-cp2": (2, ["--layout.language.cp=2", "--data.pad_to_multiple=4"]),  # vision dp2 → LLM cp2
    "llm-pp2": (2, ["--layout.language.pp=2", "--train.microbatches=2", "--data.tokens_per_microbatch=512"]),
    "vision-dp4-fan-in-llm-tp2": (4, ["--layout.vision.tp=1", "--layout.language.tp=2"]),  # dp4 → tp2 × dp2
}


def _job(root, write_folder) -> list[str]:
    """A job on the folder `write_folder` makes under `root`, a tiny chat tokenizer and image conversations."""
    _, folder = write_folder(root / "folder")
    (root / "tok").mkdir()
    return [f"--model.hf={folder}", f"--model.tokenizer={tiny_chat_tokenizer(root / 'tok')}",
            f'--data.sources=[{{path = "{_image_conversations(root / "data")}", weight = 1.0}}]',
            "--data.heldout_size=2", "--train.global_batch_size=8"]


@pytest.fixture(scope="module")
def qwen2vl_job(tmp_path_factory):
    return _job(tmp_path_factory.mktemp("qwen2vl_job"), write_qwen2vl)


@pytest.fixture(scope="module")
def qwen2_5_vl_job(tmp_path_factory):
    return _job(tmp_path_factory.mktemp("qwen2_5_vl_job"), write_qwen2_5_vl)


def test_loom_verify_passes_for_a_qwen2_5_vl_folder_with_the_llm_at_cp2(qwen2_5_vl_job, worlds):
    """Qwen2.5-VL's windowed tower (images of 20–30 merged tokens: several windows each) at dp2, the LLM at cp2."""
    per_rank = worlds.run(2, _verify, [*qwen2_5_vl_job, *LAYOUTS["llm-cp2"][1]], timeout=300)
    for checks in per_rank:
        assert len(checks) == 2 and all(c["passed"] and c["modules"] == ["language", "vision"] for c in checks), checks
        assert all(c["ref_norm"] > c["clip"] for c in checks)
    assert per_rank[0] == per_rank[1]


def test_loom_verify_passes_for_a_qwen2_5_vl_folder_with_the_tower_at_tp2_and_sequence_parallel(qwen2_5_vl_job,
                                                                                                  worlds):
    """Qwen2.5-VL's windowed tower at tp2 with its rows sharded between layers (the stream gathered for attention:
    windows whole, the merger's 2×2 groups from the gathered output), the LLM at dp2."""
    name = "vision-tp2-sp-fan-out"
    per_rank = worlds.run(2, _verify, [*qwen2_5_vl_job, *LAYOUTS[name][1]], timeout=300)
    assert_all_passed(name, per_rank, 2, ("language", "vision"))


def _verify(overrides: list[str]) -> list[dict]:
    from oracle import run_verify

    return run_verify(overrides, steps=2)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loom_verify_passes_for_a_qwen2vl_folder_under_layouts(qwen2vl_job, worlds, name):
    world, layout = LAYOUTS[name]
    per_rank = worlds.run(world, _verify, [*qwen2vl_job, *layout], timeout=300)
    assert_all_passed(name, per_rank, 2, ("language", "vision"))


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


@pytest.mark.parametrize("job,family", [("qwen2vl_job", "Qwen2VL"), ("qwen2_5_vl_job", "Qwen2_5_VL")])
def test_a_qwen2vl_job_trains_and_exports_a_folder_transformers_reads_with_equal_logits(request, job, family,
                                                                                         tmp_path, capsys):
    """One step in fp32 on a user's conversations, a checkpoint, `loom export` → one folder of the family that
    its *ForConditionalGeneration loads without a missing or unexpected tensor, its logits loom's."""
    import transformers as hf

    import loom.cli
    from loom.job import load_config
    from loom.train.trainer import Trainer
    from test_hf_qwen2vl import hf_logits, packed_samples

    qwen2vl_job = request.getfixturevalue(job)
    model_class = getattr(hf, f"{family}ForConditionalGeneration")

    from loom.data.mrope import mrope_positions
    from loom.data.spans import TokenSpans

    cfg = load_config(None, [*qwen2vl_job, "--train.steps=1", "--train.device=cpu", "--run.tensorboard=false",
                             "--run.progress=false", f"--run.out_dir={tmp_path}/run", "--data.workers=0"])
    trainer = Trainer(cfg)
    model = trainer.model
    before = model.vision.projector.linear_2.bias.detach().clone()
    trainer.train_step(trainer.batches.shard(0))
    assert not torch.equal(model.vision.projector.linear_2.bias, before)
    trainer.checkpoint()
    assert loom.cli.main(["export", str(tmp_path / "run" / "step-1"), "--hf", str(tmp_path / "hf")]) == 0
    capsys.readouterr()

    back, info = model_class.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.eval()
    samples = packed_samples(model, seed=3)  # the folder's image token; the job's placeholder is the tokenizer's
    pad = model.placeholder_ids["vision"]
    ids = torch.cat([torch.tensor(x) for x, _, _ in samples])
    ids = torch.where(ids == back.config.image_token_id, pad, ids)
    positions = torch.cat([torch.tensor(mrope_positions(x, back.config.image_token_id, g)) for x, _, g in samples])
    with torch.no_grad():
        got = model(ids, positions, TokenSpans.from_lengths([len(x) for x, _, _ in samples]),
                    {"vision": [im for _, images, _ in samples for im in images]})
    assert (got - hf_logits(back.eval(), samples)).abs().max() <= 1e-5


def test_a_tower_pipeline_loom_cannot_run_qwen2vl_under_is_named_when_the_config_loads(qwen2vl_job):
    """tp is lifted (the tower's q/k/v split by heads); pp stays refused: an encoder pipeline exists only on ranks of
    its own, and its stages pass a ViT's stream, not this tower's rotary positions and windows."""
    from loom.job import load_config
    from loom.typed_config import ConfigError

    layout = ['--layout.vision.ranks="0-1"', '--layout.language.ranks="2-3"', "--layout.vision.pp=2"]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*qwen2vl_job, *layout], world_size=4)
    assert all(f in str(err.value) for f in ("Qwen2-VL's tower", "layout.vision.pp = 1"))
    assert load_config(None, [*qwen2vl_job, "--layout.vision.tp=2"], world_size=4).layout.vision.tp == 2


def test_loom_score_of_a_qwen2vl_job_writes_each_conversations_targets_in_order(qwen2vl_job, tmp_path, capsys):
    """Scoring keeps each token's place in its sample as a field of its own: M-RoPE's positions repeat within an
    image, so they cannot order a sample's targets."""
    import json

    import loom.cli

    data = next(o for o in qwen2vl_job if o.startswith("--data.sources")).split('"')[1]
    out = tmp_path / "scores"
    assert loom.cli.main(["score", "configs/tiny.toml", f"--data={data}", f"--out={out}", *qwen2vl_job,
                          f"--run.out_dir={tmp_path}/run", "--data.workers=0"]) == 0
    capsys.readouterr()
    lines = [json.loads(x) for x in (out / "scores.jsonl").read_text().splitlines()]
    assert [x["index"] for x in lines] == list(range(16))
    for x in lines:
        assert x["targets"] and len(x["logprobs"]) == len(x["targets"]) and all(lp <= 0 for lp in x["logprobs"])
