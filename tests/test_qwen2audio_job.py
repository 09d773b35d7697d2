"""A Qwen2-Audio folder as a job's model (`[model] hf`): a user's conversations with clips of assorted lengths,
prepared as the folder's processor prepares them, under layouts against the one-process reference (`loom verify` on
gloo ranks): the tower at dp4 fanning in to the LLM at tp2·dp2, the LLM at cp2 and at pp2; then one step exported as a
`qwen2_audio` folder that transformers reads with loom's logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile

transformers = pytest.importorskip("transformers")
from qwen2audio_folders import write_qwen2audio  # noqa: E402
from test_qwen2audio_processor import qwen2audio_processor  # noqa: E402
from oracle import assert_all_passed  # noqa: E402

# (world size, overrides); the 2-rank world first (the pool keeps two worlds alive)
LAYOUTS = {
    # the tower at tp2 with its frame rows sharded between layers (dp1), gathered whole before the pooling → LLM dp2
    "audio-tp2-sp-fan-out": (2, ["--layout.audio.tp=2", "--layout.audio.sequence_parallel=true"]),
    "llm-cp2": (2, ["--layout.language.cp=2", "--data.pad_to_multiple=4"]),  # audio dp2 → LLM cp2
    # the LLM in two stages; the tower runs unpipelined on the whole step first (the three-phase step)
    "llm-pp2": (2, ["--layout.language.pp=2", "--train.microbatches=2", "--data.tokens_per_microbatch=512"]),
    "audio-dp4-fan-in-llm-tp2": (4, ["--layout.audio.tp=1", "--layout.language.tp=2"]),  # dp4 → tp2 × dp2
}


def clip_conversations(root, n: int = 16):
    """A user's JSONL of `n` conversations with 0, 1 or 2 WAV clips (8 and 16 kHz, 0.03–0.6 s) each."""
    rng = np.random.default_rng(0)
    (root / "media").mkdir(parents=True)
    lines = []
    for i in range(n):
        content = []
        for k in range(i % 3):
            rate = (8000, 16000)[(i + k) % 2]
            t = np.arange(int(rate * rng.uniform(0.03, 0.6))) / rate
            wave = 0.3 * np.sin(2 * np.pi * rng.uniform(200, 2000) * t) + 0.02 * rng.standard_normal(len(t))
            soundfile.write(root / "media" / f"{i}-{k}.wav", wave.astype(np.float32), rate)
            content.append({"type": "audio", "path": f"media/{i}-{k}.wav"})
        content.append({"type": "text", "text": "What is this?"})
        lines.append(json.dumps({"messages": [{"role": "user", "content": content},
                                              {"role": "assistant", "content": f"A cat {i}."}]}))
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    return root / "data.jsonl"


@pytest.fixture(scope="module")
def qwen2audio_job(tmp_path_factory):
    """The folder (transformers' model, its processor's tokenizer, chat template and feature extractor) and a job on
    it: (overrides, the folder)."""
    root = tmp_path_factory.mktemp("qwen2audio_job")
    _, folder = write_qwen2audio(root / "folder")
    qwen2audio_processor(folder)
    data = clip_conversations(root / "data")
    return [f"--model.hf={folder}", f"--model.tokenizer={folder}",
            f'--data.sources=[{{path = "{data}", weight = 1.0}}]', "--data.heldout_size=2",
            "--train.global_batch_size=8"]


def _verify(overrides: list[str]) -> list[dict]:
    from oracle import run_verify

    return run_verify(overrides, steps=2)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loom_verify_passes_for_a_qwen2audio_folder_under_layouts(qwen2audio_job, worlds, name):
    world, layout = LAYOUTS[name]
    per_rank = worlds.run(world, _verify, [*qwen2audio_job, *layout], timeout=300)
    assert_all_passed(name, per_rank, 2, ("audio", "language"))


def test_a_tower_layout_loom_cannot_run_qwen2audio_under_is_named_when_the_config_loads(qwen2audio_job):
    """An encoder pipeline (its own ranks): its stages would pass the unpooled rows. tp (+ SP) runs: LAYOUTS."""
    from loom.job import load_config
    from loom.typed_config import ConfigError

    layout = ['--layout.audio.ranks="0-1"', '--layout.language.ranks="2-3"', "--layout.audio.pp=2"]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*qwen2audio_job, *layout], world_size=4)
    assert all(f in str(err.value) for f in ("audio: pp = 2", "Qwen2-Audio's tower", "layout.audio.pp = 1"))
    load_config(None, [*qwen2audio_job, "--layout.audio.tp=2", "--layout.audio.sequence_parallel=true"], world_size=2)


def test_a_qwen2audio_folder_without_its_processor_config_is_named_when_the_config_loads(qwen2audio_job, tmp_path):
    import shutil

    from loom.job import load_config
    from loom.train.job_data import media_rules
    from loom.typed_config import ConfigError

    folder = next(o for o in qwen2audio_job if o.startswith("--model.hf=")).split("=", 1)[1]
    shutil.copytree(folder, tmp_path / "bare")
    (tmp_path / "bare" / "preprocessor_config.json").unlink()
    cfg = load_config(None, [*qwen2audio_job, f"--model.hf={tmp_path / 'bare'}"])
    with pytest.raises(ConfigError, match=r"model.hf = .*bare.*preprocessor_config.json is missing"):
        media_rules(cfg)


def test_a_qwen2audio_job_trains_and_exports_a_folder_transformers_reads_with_equal_logits(qwen2audio_job, tmp_path,
                                                                                            capsys):
    """One step in fp32 on a user's conversations, a checkpoint, `loom export` → one `qwen2_audio` folder that
    Qwen2AudioForConditionalGeneration loads without a missing or unexpected tensor, its logits loom's."""
    import torch
    from transformers import Qwen2AudioForConditionalGeneration

    import loom.cli
    from loom.job import load_config
    from loom.train.trainer import Trainer
    from test_hf_qwen2audio import hf_logits, loom_logits, packed_samples

    cfg = load_config(None, [*qwen2audio_job, "--train.steps=1", "--train.device=cpu", "--run.tensorboard=false",
                             "--run.progress=false", f"--run.out_dir={tmp_path}/run", "--data.workers=0"])
    trainer = Trainer(cfg)
    model = trainer.model
    before = model.audio.projector.linear.bias.detach().clone()
    trainer.train_step(trainer.batches.shard(0))
    assert not torch.equal(model.audio.projector.linear.bias, before)
    trainer.checkpoint()
    assert loom.cli.main(["export", str(tmp_path / "run" / "step-1"), "--hf", str(tmp_path / "hf")]) == 0
    capsys.readouterr()

    back, info = Qwen2AudioForConditionalGeneration.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert (tmp_path / "hf" / "preprocessor_config.json").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()
    model.eval()
    samples = packed_samples(seed=3)  # the folder's audio token; the job's placeholder is the tokenizer's
    got = loom_logits(model, samples, audio_id=model.placeholder_ids["audio"])
    assert (got - hf_logits(back.eval(), samples)).abs().max() <= 1e-5
