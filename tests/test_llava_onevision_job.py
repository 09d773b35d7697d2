"""A LLaVA-OneVision folder as a job's `[model] hf`: a user's conversations (an image alone is tiled, images of a
sample with several are a base tile each) train under a layout of its own per module with `loom verify` passing
against one process, and `loom export` writes back a llava_onevision folder transformers loads with loom's logits."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
from conftest import tiny_chat_tokenizer  # noqa: E402
from test_hf_llava import _image_conversations  # noqa: E402
from oracle import assert_all_passed  # noqa: E402


def _verify(overrides: list[str]) -> list[dict]:
    from oracle import run_verify

    return run_verify(overrides)


def _job(folder, tmp_path) -> list[str]:
    (tmp_path / "tok").mkdir()
    data = _image_conversations(tmp_path / "data")
    return [f"--model.hf={folder}", f"--model.tokenizer={tiny_chat_tokenizer(tmp_path / 'tok')}",
            f'--data.sources=[{{path = "{data}", weight = 1.0}}]', "--data.heldout_size=2",
            "--train.global_batch_size=8"]


# (world size, overrides); the 2-rank worlds first (the pool keeps two worlds alive)
LAYOUTS = {
    # the tower at tp2 with its tiles' rows sharded between layers (dp1), gathered whole before the projector and the
    # tile layout → LLM dp2
    "vision-tp2-sp-fan-out": (2, ["--layout.vision.tp=2", "--layout.vision.sequence_parallel=true"]),
    # the LLM's cp ranks each take their chunks of the tiled rows and the newline rows between them
    "llm-cp2": (2, ["--layout.language.cp=2", "--data.pad_to_multiple=4"]),
    # the LLM in two stages; the tower runs unpipelined on the whole step first (the three-phase step)
    "llm-pp2": (2, ["--layout.language.pp=2", "--train.microbatches=2", "--data.tokens_per_microbatch=1024"]),
    # the tower at dp4 fanning in to the LLM at tp2 · dp2
    "vision-dp4-fan-in-llm-tp2": (4, ["--layout.vision.tp=1", "--layout.language.tp=2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loom_verify_passes_for_a_llava_onevision_folder_under_layouts(llava_onevision, worlds, tmp_path, name):
    """Loss, gradients, grad norms and the weights after each step equal the one-process reference's,
    image_newline's included."""
    world, layout = LAYOUTS[name]
    _, folder = llava_onevision()
    per_rank = worlds.run(world, _verify, [*_job(folder, tmp_path), *layout], timeout=300)
    assert_all_passed(name, per_rank, 3, ("language", "vision"))


def test_a_llava_onevision_job_exports_a_folder_transformers_reads_with_equal_logits(llava_onevision, tmp_path,
                                                                                      capsys):
    """One step in fp32 on a user's conversations (image_newline and the tower trained too), a checkpoint, `loom
    export` → one llava_onevision folder: every tensor transformers expects, the tower's unread head as it was,
    and loom's logits on packed anyres samples."""
    import torch
    from test_hf_llava_onevision import IMAGES, hf_logits, loom_logits, samples_of
    from transformers import LlavaOnevisionForConditionalGeneration

    from vlm_jobs import one_step_exported

    from loom.job import load_config
    from loom.train.trainer import Trainer

    ref, folder = llava_onevision()
    cfg = load_config(None, [*_job(folder, tmp_path), "--train.steps=1", "--train.device=cpu", "--data.workers=0",
                             "--run.tensorboard=false", "--run.progress=false", f"--run.out_dir={tmp_path}/run"])
    trainer = Trainer(cfg)
    model = trainer.model
    assert torch.equal(model.vision.tiles.image_newline, ref.model.image_newline)
    back, original, exported = one_step_exported(trainer, tmp_path / "hf", LlavaOnevisionForConditionalGeneration,
                                                 folder)
    capsys.readouterr()
    assert not torch.equal(model.vision.tiles.image_newline, ref.model.image_newline)
    head = [k for k in original if ".head." in k or "post_layernorm" in k]
    assert head and all(torch.equal(exported[k], original[k]) for k in head)
    assert torch.equal(exported["image_newline"], model.vision.tiles.image_newline)
    samples = samples_of(model, IMAGES, seed=3)
    image_id = ref.config.image_token_index  # the folder's; the job's tokenizer added its own <image>
    as_hf = [(torch.where(ids == model.placeholder_ids["vision"], image_id, ids), items) for ids, items in samples]
    want = hf_logits(back.eval(), as_hf)
    assert want.abs().max() > 1.0
    assert (loom_logits(model.eval(), samples) - want).abs().max() <= 1e-5
