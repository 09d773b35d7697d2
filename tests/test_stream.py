"""Weight streaming (loom/rl/stream.py): under pp2·tp2 and a non-colocated layout, every rank receives, one
tensor at a time and in the manifest's order, exactly what `loom export` writes for the same weights — the
same Hugging Face names, shapes and values — and the manifest is known before the first tensor. Once the receiver
drops a tensor it is freed (at most one step late): a rank holds its shards and the tensor in flight. (Bytes are not
measured here: the CPU profiler misses the frees gloo makes on its own threads.)"""

from __future__ import annotations

import tempfile
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from loom.job import load_config


def _streamed_vs_exported(overrides: list[str]) -> dict:
    from loom.models.hf.export import export_module
    from loom.rl.stream import stream_weights
    from loom.train.build import build_job

    world = dist.get_world_size() if dist.is_initialized() else None
    job = build_job(load_config(None, ["--train.global_batch_size=4", "--data.train_size=64", *overrides],
                                world_size=world), reference=True)  # the reference: the same weights, whole
    manifest, tensors = stream_weights(job.model, job.cfg.model, torch.float32)
    with tempfile.TemporaryDirectory() as out:
        exported = {}
        for kind in ["language", *job.cfg.model.encoders]:
            module = job.reference.language if kind == "language" else job.reference.encoder(kind).encoder
            exported[kind] = load_file(export_module(module, Path(out) / kind) / "model.safetensors")
    names = {kind: set(t) for kind, t in exported.items()}
    streamed, mismatched, earlier, kept = {kind: set() for kind in exported}, [], [], 0
    for entry, t in tensors:
        kept = max(kept, sum(ref() is not None for ref in earlier))  # earlier tensors the stream still holds
        streamed[entry.module].add(entry.name)
        want = exported[entry.module][entry.name]
        if tuple(t.shape) != entry.shape or not torch.equal(t, want):
            mismatched.append(entry.name)
        earlier.append(weakref.ref(t))
        del t  # the receiver is done with it
    return {"same_names": streamed == names, "mismatched": mismatched, "n": len(manifest),
            "owners": sorted({e.owner for e in manifest}), "kept": kept}


def placed(encoders: str, llm: str) -> list[str]:
    return [f"--layout.vision.ranks={encoders}", f"--layout.audio.ranks={encoders}", f"--layout.language.ranks={llm}"]


LAYOUTS = {
    "llm-pp2xtp2": (4, ["--layout.language.pp=2", "--layout.language.tp=2", "--layout.vision.tp=2",
                        "--layout.audio.tp=2", "--train.microbatches=2", "--data.tokens_per_microbatch=512"]),
    "noncolocated-llm-tp2": (3, placed("0-0", "1-2") + ["--layout.language.tp=2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_stream_equals_loom_export(worlds, name):
    world, overrides = LAYOUTS[name]
    per_rank = worlds.run(world, _streamed_vs_exported, overrides, timeout=300)
    for rank, r in enumerate(per_rank):
        assert r["same_names"] and not r["mismatched"], (name, rank, r)
        # at most the one sent before is still alive when the next arrives (on some ranks a collective's
        # bookkeeping releases it a step late), never a growing set
        assert r["kept"] <= 1, f"{name} rank {rank}: the stream held {r['kept']} tensors it had already sent"
        assert r["n"] == per_rank[0]["n"] > 0
    assert len(per_rank[0]["owners"]) > 1, "every tensor came from one rank: the layout spread nothing"
