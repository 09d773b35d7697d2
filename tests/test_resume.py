"""Sharded checkpoints: a run stopped at step k and resumed continues exactly (same layout: bit-identical on
CPU), or to ≤ 1e-6 under another layout (reshard); an interrupted save never becomes the checkpoint that
loads; bad checkpoints are refused before any weight is overwritten."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_job_overrides

from loom.checkpoint.folders import latest_checkpoint
from loom.checkpoint.sharded import CheckpointError, load_sharded
from loom.job import load_config
from loom.train.trainer import Trainer

# colocated and heterogeneous: vision tp2 (dp2), audio dp4, the LLM cp2 (dp2)
HETERO_CP = ["--layout.vision.tp=2", "--layout.language.cp=2"]
LLM_TP2 = ["--layout.language.tp=2"]
PIPELINE = ["--train.microbatches=2", "--data.tokens_per_microbatch=512"]


def _job(out_dir, steps: int, save_every: int, resume: str, overrides: list[str]) -> list[str]:
    return tiny_job_overrides(out_dir, f"--train.steps={steps}", f"--run.save_every={save_every}",
                              f"--run.resume={resume}", *overrides)


def _train(out_dir: str, steps: int, save_every: int, resume: str, overrides: list[str]) -> int:
    """On every rank of a world: `loom train` of the tiny job; returns the step it started from."""
    import torch.distributed as dist

    trainer = Trainer(load_config(None, _job(out_dir, steps, save_every, resume, overrides),
                                  world_size=dist.get_world_size()))
    start = trainer.step
    trainer.run()
    return start


def _losses(out_dir: Path) -> dict[int, tuple[float, float]]:
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, lines) if r["kind"] == "train"}


def _one_process(out_dir, steps: int, save_every: int, resume: str, overrides: list[str] = ()) -> int:
    trainer = Trainer(load_config(None, _job(out_dir, steps, save_every, resume, list(overrides))))
    start = trainer.step
    trainer.run()
    return start


def _assert_continues(straight: Path, resumed: Path, steps: list[int], exact: bool) -> None:
    a, b = _losses(straight), _losses(resumed)
    assert sorted(b) == steps
    for s in steps:
        if exact:
            assert b[s] == a[s], (s, b[s], a[s])
        else:
            assert b[s] == pytest.approx(a[s], rel=1e-6, abs=0), (s, b[s], a[s])


@pytest.fixture(scope="module")
def hetero_run(worlds, tmp_path_factory):
    """4 steps under the heterogeneous layout with CP on 4 ranks, a checkpoint after step 2."""
    out = tmp_path_factory.mktemp("hetero")
    worlds.run(4, _train, str(out), 4, 2, "", HETERO_CP, timeout=300)
    return out


def test_resume_under_the_same_layout_is_bit_identical(worlds, hetero_run, tmp_path):
    starts = worlds.run(4, _train, str(tmp_path), 4, 0, str(hetero_run / "step-2"), HETERO_CP, timeout=300)
    assert starts == [2] * 4
    _assert_continues(hetero_run, tmp_path, [3, 4], exact=True)


def test_reshard_cp2_and_tp2_to_plain_dp4(worlds, hetero_run, tmp_path):
    worlds.run(4, _train, str(tmp_path), 4, 0, str(hetero_run / "step-2"), [], timeout=300)
    _assert_continues(hetero_run, tmp_path, [3, 4], exact=False)


def test_reshard_four_ranks_to_one_process(hetero_run, tmp_path):
    assert _one_process(tmp_path, 4, 0, str(hetero_run / "step-2")) == 2
    _assert_continues(hetero_run, tmp_path, [3, 4], exact=False)


def test_reshard_one_process_to_llm_tp2_dp2(worlds, tmp_path):
    straight = tmp_path / "straight"
    _one_process(straight, 4, 2, "")
    worlds.run(4, _train, str(tmp_path / "resumed"), 4, 0, str(straight / "step-2"), LLM_TP2, timeout=300)
    _assert_continues(straight, tmp_path / "resumed", [3, 4], exact=False)


def test_reshard_dp4_to_llm_tp2_dp2(worlds, tmp_path):
    straight = tmp_path / "straight"
    worlds.run(4, _train, str(straight), 4, 2, "", [], timeout=300)
    worlds.run(4, _train, str(tmp_path / "resumed"), 4, 0, str(straight / "step-2"), LLM_TP2, timeout=300)
    _assert_continues(straight, tmp_path / "resumed", [3, 4], exact=False)


@pytest.mark.parametrize("name,world,overrides", [
    ("llm-pp2-tied", 2, ["--layout.language.pp=2", *PIPELINE]),
    ("noncolocated", 3, ["--layout.vision.ranks=0-0", "--layout.audio.ranks=0-0", "--layout.language.ranks=1-2",
                         *PIPELINE]),
])
def test_reshard_pipeline_and_noncolocated_to_one_process_and_back(worlds, tmp_path, name, world, overrides):
    """Saved under pp (the tied head copy saved under the embedding's name) or non-colocated (each rank its
    modules), resumed on one process; and the one-process checkpoint resumed under the layout."""
    straight = tmp_path / "straight"
    worlds.run(world, _train, str(straight), 4, 2, "", overrides, timeout=300)
    _one_process(tmp_path / "to-one", 4, 0, str(straight / "step-2"), PIPELINE)
    _assert_continues(straight, tmp_path / "to-one", [3, 4], exact=False)
    worlds.run(world, _train, str(tmp_path / "back"), 4, 0, str(tmp_path / "to-one" / "step-4"), overrides,
               timeout=300)  # nothing left to train: the checkpoint loads under the layout and evaluates
    assert _losses(tmp_path / "back") == {}


# the encoders on ranks 0-1 (two layers each), the LLM on 2-3: pipelined encoders (pp2) or two replicas (dp2)
ENCODERS_APART = ["--layout.vision.ranks=0-1", "--layout.audio.ranks=0-1", "--layout.language.ranks=2-3",
                  "--model.vision.num_layers=2", "--model.audio.num_layers=2", *PIPELINE]
ENCODERS_PP2 = [*ENCODERS_APART, "--layout.vision.pp=2", "--layout.audio.pp=2"]


def test_encoder_pp2_resumes_itself_bitwise_and_reshards_to_pp1_and_back(worlds, tmp_path):
    """Saved with the encoders pipelined (each stage its layers, under one-process names): resumed under the
    same layout bit for bit, under encoder pp1 (dp2) to 1e-6; and a pp1 checkpoint resumed under pp2."""
    straight, same, pp1, back = (tmp_path / name for name in ("straight", "same", "pp1", "back"))
    worlds.run(4, _train, str(straight), 4, 2, "", ENCODERS_PP2, timeout=300)
    worlds.run(4, _train, str(same), 4, 0, str(straight / "step-2"), ENCODERS_PP2, timeout=300)
    _assert_continues(straight, same, [3, 4], exact=True)
    worlds.run(4, _train, str(pp1), 4, 1, str(straight / "step-2"), ENCODERS_APART, timeout=300)
    _assert_continues(straight, pp1, [3, 4], exact=False)
    worlds.run(4, _train, str(back), 4, 0, str(pp1 / "step-3"), ENCODERS_PP2, timeout=300)
    _assert_continues(pp1, back, [4], exact=False)


# ---------------------------------------------------------------- crash safety and bad checkpoints

_KILLED_CHILD = """
import sys, time
import loom.checkpoint.sharded as sharded
from loom.job import load_config
from loom.train.trainer import Trainer
real_save = sharded.dcp.save
def slow_save(state, storage_writer, **kw):
    real_save(state, storage_writer=storage_writer, **kw)
    if "step-2.tmp" in str(storage_writer.path):
        print("SAVING", flush=True)
        time.sleep(120)  # killed here: step 2's shards are written, its state.json is not
sharded.dcp.save = slow_save
Trainer(load_config(None, sys.argv[1:])).run()
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    out = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, *_job(out, 3, 1, "", [])],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    for line in child.stdout:
        if line.startswith("SAVING"):
            child.send_signal(signal.SIGKILL)
            break
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert (out / "step-2.tmp").is_dir() and not (out / "step-2").exists()
    assert latest_checkpoint(out) == out / "step-1"

    assert _one_process(out, 3, 1, "auto") == 1  # resumes from step 1, redoes step 2 and its save
    assert latest_checkpoint(out) == out / "step-3" and not (out / "step-2.tmp").exists()
    straight = tmp_path / "straight"
    _one_process(straight, 3, 1, "")
    _assert_continues(straight, out, [1, 2, 3], exact=True)  # metrics.jsonl holds both tries of step 2


def test_auto_resume_with_no_checkpoint_starts_fresh_and_keep_last_prunes(tmp_path):
    assert _one_process(tmp_path, 3, 1, "auto") == 0
    trainer = Trainer(load_config(None, _job(tmp_path, 5, 1, "auto", ["--run.keep_last=2"])))
    assert trainer.step == 3
    trainer.run()
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-4", "step-5"]


def test_bad_checkpoints_are_refused_before_any_weight_changes(hetero_run, tmp_path):
    ckpt = hetero_run / "step-2"
    def refused(trainer, path, match):
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        with pytest.raises(CheckpointError, match=match):
            load_sharded(path, trainer.model, trainer.optimizer, trainer.weight_aliases)
        assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())

    other = Trainer(load_config(None, _job(tmp_path / "o", 4, 0, "", ["--model.language.intermediate_size=96"])))
    refused(other, ckpt, r"language\.layers\.0\.mlp\.\w+_proj\.weight is saved as \(\d+, \d+\), the model has")
    trainer = Trainer(load_config(None, _job(tmp_path / "t", 4, 0, "", [])))

    import shutil

    holes = tmp_path / "missing-shard"
    shutil.copytree(ckpt, holes)
    sorted(holes.glob("shard-*.safetensors"))[0].unlink()
    refused(trainer, holes, r"missing shard")

    truncated = tmp_path / "truncated"
    shutil.copytree(ckpt, truncated)
    shard = sorted(truncated.glob("shard-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    refused(trainer, truncated, r"cannot read the shard files")

    incomplete = tmp_path / "incomplete"
    shutil.copytree(ckpt, incomplete)
    (incomplete / "state.json").unlink()
    refused(trainer, incomplete, r"no state.json")

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "latest").write_text("step-9\n")
    with pytest.raises(CheckpointError, match=r"names step-9, which is not a complete checkpoint"):
        latest_checkpoint(tmp_path / "run")


def test_export_reads_a_sharded_checkpoint_tensor_by_tensor(hetero_run, tmp_path):
    """`loom export` of the sharded step-4 of a 4-rank run (read tensor by tensor) writes the HF folders of the
    model that one process resumed from it (DCP's resharding load) holds."""
    from safetensors.torch import load_file

    import loom.cli
    from loom.models.hf import export_module

    assert loom.cli.main(["export", str(hetero_run / "step-4"), "--hf", str(tmp_path / "exported")]) == 0
    model = Trainer(load_config(None, _job(tmp_path / "resumed", 4, 0, str(hetero_run / "step-4"), []))).model
    for module in ("language", "vision", "audio"):
        ours = model.language if module == "language" else model.encoder(module).encoder
        a = load_file(tmp_path / "exported" / module / "model.safetensors")
        b = load_file(export_module(ours, tmp_path / "resumed-hf" / module) / "model.safetensors")
        assert a.keys() == b.keys() and len(a) > 3
        assert all(torch.equal(a[k], b[k]) for k in a), module


def test_async_save_publishes_the_same_checkpoints(worlds, hetero_run, tmp_path):
    """run.async_save on 4 ranks: training goes on while step 2's files are written (its own gloo group), the
    checkpoint is published at the next save, and holds the same tensors as the synchronous run's."""
    from loom.checkpoint.read import CheckpointWeights

    worlds.run(4, _train, str(tmp_path), 4, 2, "", [*HETERO_CP, "--run.async_save=true"], timeout=300)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-4"
    _assert_continues(hetero_run, tmp_path, [1, 2, 3, 4], exact=True)
    a, b = CheckpointWeights(hetero_run / "step-2"), CheckpointWeights(tmp_path / "step-2")
    assert a.names == b.names
    assert all(torch.equal(a.get(n), b.get(n)) for n in a.names)


def test_a_parameter_adamw_has_not_stepped_yet_resumes_without_state(tmp_path):
    """A parameter with no gradient so far has no AdamW state, so the checkpoint holds none for it: the load
    must not refuse the checkpoint, and must leave that parameter without state (as the uninterrupted run
    has), not with the zeros torch creates when it initialises a fresh optimizer."""
    trainer = Trainer(load_config(None, _job(tmp_path / "a", 2, 0, "", [])))
    trainer.train_step()
    name = "audio.encoder.layers.0.mlp.fc1.weight"
    param = dict(trainer.model.named_parameters())[name]
    owner = next(opt for opt in trainer.optimizer if param in opt.state)
    del owner.state[param]  # as if it had had no gradient yet
    trainer.checkpoint()
    fresh = Trainer(load_config(None, _job(tmp_path / "b", 2, 0, str(tmp_path / "a" / "step-1"), [])))
    assert fresh.step == 1
    params = dict(fresh.model.named_parameters())
    assert params[name] not in fresh.optimizer.state
    assert params["language.embed_tokens.weight"] in fresh.optimizer.state


def test_saving_leaves_an_optimizer_that_has_not_stepped_untouched(tmp_path):
    """A module whose optimizer has no state yet (none of its parameters had a gradient): saving must not
    create any (torch's state-dict helper would step it once with zero gradients), and the checkpoint holds
    none for it."""
    from loom.checkpoint.read import CheckpointWeights
    from loom.checkpoint.sharded import saved_metadata

    trainer = Trainer(load_config(None, _job(tmp_path, 2, 0, "", [])))
    trainer.train_step()
    trainer.optimizer.by_module["audio"].state.clear()  # as if no audio had come yet
    trainer.checkpoint()
    assert not trainer.optimizer.by_module["audio"].state
    saved = saved_metadata(tmp_path / "step-1")
    assert not any(k.startswith("optim.audio.") for k in saved)
    assert any(k.startswith("optim.language.") for k in saved)
    assert "audio.encoder.conv1.weight" in CheckpointWeights(tmp_path / "step-1").names
    resumed = Trainer(load_config(None, _job(tmp_path / "r", 2, 0, str(tmp_path / "step-1"), [])))
    assert not resumed.optimizer.by_module["audio"].state and resumed.optimizer.by_module["language"].state
