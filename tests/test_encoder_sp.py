"""Sequence parallel encoders (`[layout.vision] sequence_parallel = true`): between the layers each tp rank
holds only its share of the packed rows, and the encoder's output is every row again. That the results
equal the one-process reference is tests/test_parity.py ("encoders-tp2-sp" and the others)."""

from __future__ import annotations

from conftest import tiny_job_overrides

from loom.job import load_config


def _rows_seen(overrides: list[str], out: str) -> dict:
    """One training step; the rows (on this rank) entering each vision layer's norm and leaving the encoder."""
    import torch.distributed as dist

    from loom.train.trainer import Trainer

    t = Trainer(load_config(None, tiny_job_overrides(out, *overrides), world_size=dist.get_world_size()))
    seen = {"layer_norm1": [], "encoder": []}
    encoder = t.model.vision.encoder
    local = lambda x: x.to_local() if hasattr(x, "to_local") else x  # noqa: E731
    for layer in encoder.layers:
        layer.layer_norm1.register_forward_hook(lambda m, i, o: seen["layer_norm1"].append(local(o).shape[0]))
    encoder.register_forward_hook(lambda m, i, o: seen["encoder"].append(local(o).shape[0]))
    t.train_step()
    t.prefetch.close()
    return seen


def test_encoder_rows_are_sharded_between_layers_and_whole_after(worlds, tmp_path):
    """vision tp2 on 2 ranks, the same step with and without SP."""
    tp2 = ["--layout.vision.tp=2", "--layout.audio.tp=2"]
    whole = worlds.run(2, _rows_seen, tp2, str(tmp_path / "no-sp"), timeout=180)
    split = worlds.run(2, _rows_seen, [*tp2, "--layout.vision.sequence_parallel=true"], str(tmp_path / "sp"),
                       timeout=180)
    for w, s in zip(whole, split):
        assert all(rows % 64 == 0 for rows in w["layer_norm1"])  # the packed rows, padded with the filler item
        assert s["layer_norm1"] == [rows // 2 for rows in w["layer_norm1"]]  # each rank: half of them
        assert s["encoder"] == w["encoder"]  # every row again, the filler removed
