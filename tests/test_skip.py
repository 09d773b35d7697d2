"""A non-finite gradient on one rank skips the optimizer step on every rank.

On 4 gloo ranks with loom's heterogeneous default layout (vision tp2·dp2, audio and LLM dp4), after one
normal step, one element of one parameter's gradient is made NaN in rank 2's local shard only, after
FSDP's reduce-scatter and before the grad norm, so the other ranks' own gradients stay finite. Every rank
must then skip the step (the decision is global), with its local weights and AdamW state bit-identical to
before, the step counters and lr in lockstep, and the next step must train normally again.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from conftest import tiny_job_overrides
from loom.job import load_config
from loom.train.optim import lr_factor

BAD_RANK = 2
OVERRIDES = ["--layout.vision.tp=2", "--train.global_batch_size=8", "--train.warmup_steps=4"]  # lr differs each step


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _weights(model) -> list[torch.Tensor]:
    return [_local(p.detach()).clone() for p in model.parameters()]


def _same_weights(model, snapshot: list[torch.Tensor]) -> bool:
    return all(torch.equal(_local(p.detach()), w) for p, w in zip(model.parameters(), snapshot, strict=True))


def _opt_state(optimizer) -> dict[int, dict[str, torch.Tensor]]:
    # keyed by the parameter's identity: the same parameter objects live through the whole run
    return {id(p): {k: _local(v).clone() for k, v in st.items()} for p, st in optimizer.state.items()}


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[p].keys() == b[p].keys() and all(torch.equal(a[p][k], b[p][k]) for k in a[p]) for p in a)


def _skip_on_one_rank(out_dir: str, poisoned: str, overrides: list[str]) -> dict:
    import loom.train.step as step_mod
    from loom.train.trainer import Trainer

    rank = dist.get_rank()
    cfg = load_config(None, tiny_job_overrides(out_dir, *overrides), world_size=dist.get_world_size())
    t = Trainer(cfg)
    first = t.train_step()
    weights, state, step_before = _weights(t.model), _opt_state(t.optimizer), t.step
    held = {name for name, _ in t.model.named_parameters()}  # non-colocated: a rank holds only its modules
    param = t.model.get_parameter(poisoned) if poisoned in held else None
    original, local_finite = step_mod.clip_and_check, []

    def poisoned_clip_and_check(model, max_norm, share=None):
        # after backward and FSDP's reductions, before the global norm: a fault on one rank's shard only
        if rank == BAD_RANK:
            _local(param.grad).view(-1)[0] = float("nan")
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        local_finite.append(all(bool(g.isfinite().all()) for g in grads))
        return original(model, max_norm, share)

    step_mod.clip_and_check = poisoned_clip_and_check
    try:
        bad = t.train_step()
    finally:
        step_mod.clip_and_check = original
    out = {
        "placements": str(getattr(param, "placements", "plain")),
        "shard_numel": None if param is None else _local(param).numel(),
        "first_skipped": first.skipped,
        "state_params": len(state),
        "step_before": step_before,
        "local_finite": local_finite,
        "skipped": bad.skipped,
        "grad_norm": bad.grad_norm,
        "lr": bad.lr,
        "weights_same": _same_weights(t.model, weights),
        "state_same": _same_state(state, _opt_state(t.optimizer)),
        "grads_cleared": all(p.grad is None for p in t.model.parameters()),
        "step_after_bad": t.step,
    }
    good = t.train_step()
    return out | {
        "good_skipped": good.skipped,
        "good_loss": good.loss,
        "good_grad_norm": good.grad_norm,
        "good_lr": good.lr,
        "good_changed": not _same_weights(t.model, weights),
        "step_end": t.step,
        "lr_expected": [cfg.train.lr * lr_factor(s, cfg.train) for s in (1, 2)],
    }


# the encoders on ranks 0-1 (vision tp2), the LLM dp2 on ranks 2-3: the NaN is on an LLM rank, and the
# encoder ranks, which never see the LLM's gradients, must skip too (Megatron #5331)
NONCOLOCATED = OVERRIDES + ["--layout.vision.ranks=0-1", "--layout.audio.ranks=0-1", "--layout.language.ranks=2-3"]


@pytest.mark.parametrize("poisoned,overrides", [
    ("vision.encoder.patch_embedding.weight", OVERRIDES),  # vision's dp mesh only: its tp pair (2, 3) hold copies
    ("vision.encoder.layers.0.mlp.fc1.weight", OVERRIDES),  # sharded over vision's dp × tp mesh
    ("language.embed_tokens.weight", OVERRIDES),  # sharded over the LLM's dp4
    ("language.embed_tokens.weight", NONCOLOCATED),  # sharded over the LLM's dp2 on its own ranks
], ids=["vision-dp", "vision-dp-tp", "language", "language-noncolocated"])
def test_nan_on_one_rank_skips_the_step_everywhere(worlds, tmp_path, poisoned, overrides):
    """NaN in one local gradient shard of rank 2 → every rank skips: weights and optimizer state unchanged
    bit for bit, step counters and lr equal across ranks, and the next step trains normally on all."""
    per_rank = worlds.run(4, _skip_on_one_rank, str(tmp_path), poisoned, overrides, timeout=300)
    assert per_rank[BAD_RANK]["shard_numel"], f"rank {BAD_RANK} holds no shard of {poisoned}"
    for rank, r in enumerate(per_rank):
        where = f"rank {rank}, NaN in {poisoned} {r['placements']} on rank {BAD_RANK}"
        assert r["shard_numel"] is None or r["shard_numel"] > 0, where
        assert not r["first_skipped"] and r["state_params"] > 0, where  # AdamW moments exist before the fault
        assert r["local_finite"] == [rank != BAD_RANK], f"{where}: the fault must be on rank {BAD_RANK} alone"
        assert r["skipped"] and not math.isfinite(r["grad_norm"]), f"{where}: step taken, grad norm {r['grad_norm']}"
        assert r["weights_same"], f"{where}: a skipped step changed the weights"
        assert r["state_same"], f"{where}: a skipped step changed the optimizer state"
        assert r["grads_cleared"], f"{where}: the NaN gradients were kept for the next step"
        assert r["step_after_bad"] == r["step_before"] + 1 == 2, where  # the skipped step still counts
        assert [r["lr"], r["good_lr"]] == r["lr_expected"], where  # the schedule follows the counter
        assert not r["good_skipped"] and math.isfinite(r["good_grad_norm"]) and r["good_changed"], where
        assert r["step_end"] == 3, where
    for key in ("step_after_bad", "lr", "good_loss", "good_grad_norm", "good_lr"):  # lockstep across ranks
        values = [r[key] for r in per_rank]
        assert len(set(values)) == 1, f"{key} differs between ranks: {values}"
